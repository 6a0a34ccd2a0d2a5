// Sparse attention with a per-head sink over the paged 584-byte FP8 caches (spec §5.2-5.3,
// §12.2), decode (1-4 query tokens per sequence) and prefill, on BF16 tensor cores — exactly
// the semantics of cpu::sparse_attention as CpuModel::attention calls it:
//
// For a query token at position p of sequence s, the keys in canonical order are
//   1. the window: positions max(0, p-W+1) .. p, oldest first, padded with invalid slots to
//      W entries (W = `window`);
//   2. the compressed entries: ratio 4 (CSA) the indexer's top-k row of the token in its
//      order (-1 = invalid); ratio 128 (HCA) entries 0 .. (p+1)/128 - 1; ratio 0 none.
// Scores are fp32 (q . k) * softmax_scale over all 512 dims; the softmax runs over blocks of
// 64 keys of that list with the running max, the probabilities rounded to BF16 against the
// running max before P.V; invalid keys contribute nothing; the sink only enters the
// denominator; value = key (the same 512 dims); output BF16. Keys are read from the caches as
// stored (448 e4m3 x UE8M0 per 64, 64 BF16 RoPE) and decoded to BF16 exactly in the kernel.
//
// Window keys of the batch's own tokens (a prefill chunk, or the 2-4 tokens of a speculative
// decode step) are not in the ring yet — writing them first would overwrite entries older
// queries of the batch still attend to. The caller passes them in `staged_*`: the encoded
// entries of every token of the batch, in batch token order, laid out like one cache page
// (576 data bytes per token, and 8 scale bytes per token in a separate array). A window
// position j of sequence s is read from the staged entries when j >= seq_pos0[s] (staged
// entry cu_seqlens[s] + j - seq_pos0[s]) and from the ring slot j % W otherwise, so the ring
// must hold the W positions before each sequence's first batch token. With staged_data ==
// nullptr every window position is read from the ring (decode of one token whose entry the
// caller has inserted already).
//
// Compressed entries are read through the compressed store's block table; CSA indices
// outside [0, (p+1)/4) are treated as invalid like -1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/cuda/common/paged_cache.h"
#include "ops/cuda/sparse_attention/attn_batch.h"
#include "ops/cuda/sparse_attention/sparse_attention_plan.h"

namespace dsv4::cuda {

struct SparseAttnParams {
  AttnBatch batch;
  int n_heads = 0;     // 4, 8, 16, 32, 64, 128 (any multiple of 16, or 4 / 8)
  int head_dim = 512;  // only 512 = 448 FP8 NoPE + 64 BF16 RoPE (KvEntryLayout{})
  float softmax_scale = 0.0f;
  const float* sink = nullptr;  // device [n_heads], the attention sink logits

  const __nv_bfloat16* q = nullptr;  // [num_tokens, n_heads, 512]
  __nv_bfloat16* out = nullptr;      // [num_tokens, n_heads, 512]

  // Sliding window.
  int window = 0;                          // window_size W (ring slots), 1..4096
  PagedStoreView window_cache;             // the layer's window ring (kv_store_view)
  const uint8_t* staged_data = nullptr;    // [num_tokens, 576] or nullptr (see above)
  const uint8_t* staged_scales = nullptr;  // [num_tokens, 8]

  // Compressed entries.
  int ratio = 0;                      // 0 (SWA only), 4 (CSA) or 128 (HCA)
  PagedStoreView comp_cache;          // the layer's compressed store (kv_store_view)
  const int32_t* topk_idx = nullptr;  // ratio 4: [num_tokens, topk_stride] entry indices
  int topk = 0;                       // ratio 4: indices used per token (<= 1024)
  int64_t topk_stride = 0;

  // Scratch: split-KV partials and, for kWgmmaPredecoded, the keys decoded to BF16
  // (sparse_attention_workspace_bytes sizes it for the plan); may be null when that is 0. kAuto
  // takes the predecoded keys only when they fit what is offered here (the engine offers its
  // whole attention workspace, CudaModelLimits::attn_workspace_bytes).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  // Overrides of the heuristic (0 / kAuto = let it choose), for tests and benchmarks.
  SparseAttnKernel kernel = SparseAttnKernel::kAuto;
  int heads_per_cta = 0;  // 16, 32 or 64 (kMma); 64 (kWgmma, kWgmmaDirect)
  int num_splits = 0;     // key-block splits per (token, head tile), combined afterwards

  // Programmatic dependent launch: the attention kernel may start while the kernel before it on
  // the stream finishes (it waits in griddepcontrol.wait before its first global access);
  // graph-capturable. The split combine always follows the attention kernel programmatically.
  bool pdl = false;
};

// The planner's view of these parameters (validates them), and its choice
// (sparse_attention_plan.h). kAuto plans within the workspace offered in p.workspace /
// p.workspace_bytes (none: nothing beyond what the plan sizes itself).
SparseAttnShape sparse_attention_shape(const SparseAttnParams& p);
SparseAttnPlan sparse_attention_plan(const SparseAttnParams& p);
size_t sparse_attention_workspace_bytes(const SparseAttnParams& p);
void sparse_attention(const SparseAttnParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
