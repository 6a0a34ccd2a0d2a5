// Lightning indexer on the GPU (CSA layers, spec §7): query path, logits against the paged
// MXFP4 indexer-key cache, causal visibility and top-k — with the reference's rounding points
// (cpu::hadamard_rotate, cpu::fake_quant_fp4, cpu::indexer_scores, cpu::topk_desc).
//
// Pipeline of one CSA layer (all on `stream`):
//   indexer_query  : qI = wq_b(qr) [T, H, 128] BF16 (another kernel's FP8 GEMM) ->
//                    RoPE on dims 64..127 at the token's position (the layer's compressed-RoPE
//                    table) -> Hadamard 128 (fp32 butterflies, x 128^-1/2, BF16) -> FP4
//                    fake-quant per 32  => q_fp4 [T, H, 128] BF16;
//                    w = bf16(bf16(weights_proj(x)) * (128^-1/2 * H^-1/2))  => weights [T, H].
//   indexer_logits : score[t, i] = bf16(sum_h bf16(relu(bf16(q_h . K_i)) * w_h)) for every
//                    compressed entry i visible to token t (i < (p+1)/4), K_i read from the
//                    MXFP4 cache => scores [T, score_stride] BF16 (entries >= visible untouched).
//   indexer_topk   : the min(topk, visible) best entries, descending score, ties to the lower
//                    index (exactly cpu::topk_desc), -1 in the unused slots => topk_idx [T, topk].
//
// Numerics: q_fp4 and weights are bit-identical to the CPU op (RoPE cos/sin from the fp32
// frequencies in double precision as RopeTable::cos_sin does). The logits use BF16 tensor
// cores on the exact FP4 values (each key's block scales are folded in relative to its largest
// block scale, whose power of two is applied after the head sum, which commutes exactly with
// every BF16 rounding); products of e2m1 values are exact and the fp32 sums are exact unless a
// key's or a query's block scales span more than ~2^9, or the head terms span more than 2^16 —
// then the result can differ from the CPU's double-precision dot only where an fp32 rounding
// decides a BF16 rounding (~2^-16 of such cases). Top-k on identical scores is identical.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/cuda/common/paged_cache.h"
#include "ops/cuda/sparse_attention/attn_batch.h"

namespace dsv4::cuda {

// Which kernel computes the logits (an override for tests and benchmarks). kAuto takes the
// warpgroup-MMA kernel: measured faster than mma.sync at every benchmarked shape (H200,
// 2026-12-04: batch 1-256, s_q 1-4, 16K-128K context, prefill 4K / 8K).
enum class IndexerLogitsPath {
  kAuto,
  kMma,    // mma.sync m16n8k16: 4 warps x 32 keys a tile
  kWgmma,  // warpgroup MMA: 64 keys x every head a wgmma chain, head sum on the tensor cores
};

struct IndexerParams {
  AttnBatch batch;
  int n_heads = 0;     // index_n_heads: 1..64
  int head_dim = 128;  // index_head_dim: only 128 (Hadamard 128, 4 FP4 blocks, RoPE 64)
  int rope_dim = 64;   // qk_rope_head_dim: only 64
  int ratio = 4;  // compress ratio of the keys: entry i visible to position p iff i < (p+1)/ratio
  int topk = 0;   // index_topk, 1..1024

  // Inputs.
  const __nv_bfloat16* q = nullptr;      // [num_tokens, n_heads, 128] = indexer.wq_b(qr)
  const __nv_bfloat16* wproj = nullptr;  // [num_tokens, n_heads] = indexer.weights_proj(x)
  const float* inv_freq = nullptr;       // device [rope_dim / 2]: RopeTable::inv_freq of the layer
  PagedStoreView keys;                   // the layer's MXFP4 indexer-key store (index_store_view)

  // Outputs (and intermediates the next stage reads).
  __nv_bfloat16* q_fp4 = nullptr;    // [num_tokens, n_heads, 128]
  __nv_bfloat16* weights = nullptr;  // [num_tokens, n_heads]
  __nv_bfloat16* scores = nullptr;   // [num_tokens, score_stride]
  int64_t score_stride = 0;          // >= (batch.max_position + 1) / ratio
  int32_t* topk_idx = nullptr;       // [num_tokens, topk] compressed-entry indices, -1 = unused

  // CTAs a row of the top-k (a cluster): 0 picks by batch; 1, 2, 4 or 8 forces it (tests and
  // benchmarks; an error where the rows do not fit that many).
  int topk_ctas_per_row = 0;
  IndexerLogitsPath logits_path = IndexerLogitsPath::kAuto;
  // Programmatic dependent launch of the stage's first kernel: it may start while the kernel
  // before it on the stream finishes (each kernel here waits in griddepcontrol.wait before its
  // first global access and lets its successor launch at once); graph-capturable.
  // lightning_indexer launches its second and third stages programmatically whatever this says.
  bool pdl = false;
};

// Largest visible-entry count per token the top-k accepts (1M tokens of context at ratio 4).
constexpr int64_t kIndexerMaxVisible = 262144;
constexpr int kIndexerMaxTopk = 1024;

void indexer_query(const IndexerParams& p, cudaStream_t stream);
void indexer_logits(const IndexerParams& p, cudaStream_t stream);
void indexer_topk(const IndexerParams& p, cudaStream_t stream);
// The three stages in order.
void lightning_indexer(const IndexerParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
