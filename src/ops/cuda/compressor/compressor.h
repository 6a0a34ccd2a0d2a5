// The KV compressors on the GPU (cpu::compressor_store / compressor_pool / compressor_finish +
// cpu::encode_kv_entry or cpu::encode_index_key), for a batch of sequences, each contributing a
// chunk of consecutive tokens: prefill (many tokens, blocks completing inside the chunk) and
// decode (1-4 tokens per sequence, many sequences) alike.
//
// Supported: ratio 4 (overlapping, coff 2) with d = 512 (main KV -> 584-byte FP8 entries) or
// d = 128 (indexer keys -> Hadamard + MXFP4 68-byte keys), and ratio 128 (coff 1) with d = 512
// (main KV). The fp32 projections a = wkv(x), g = wgate(x) ([tokens, coff*d], the reference
// runs them in fp32) are INPUTS, computed by a GEMM elsewhere; this op adds ape, keeps the
// per-sequence state, pools, normalises, rotates, quantises and inserts.
//
// State: per sequence, the exact fp32 layout of CompressorStateLayout (kv rows then score
// rows) at states + state_slot[s] * layout.floats(); carried in and out, bit-identical to the
// CPU's state after the same tokens (including rows the CPU leaves stale). A fresh sequence's
// state must be reset (kv 0, score -inf) by the caller, as HostCache::reset_states does.
// Entries: compressed entry i of sequence s goes to row s of the store's block table at
// i / page_size, slot i % page_size (PagedStoreView).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/common/paged_cache.h"

namespace dsv4::cuda {

enum class CompressorPath {
  kAuto,   // kFused when every sequence brings at most `ratio` tokens (decode), else kSplit
  kFused,  // one kernel: a cluster per sequence pools its completing blocks, then updates
           // the state (correct for any chunk, fast for short ones)
  kSplit,  // two kernels: a cluster per completing block, then the state update
};

struct CompressorParams {
  int ratio = 4;         // 4 or 128
  int dim = 512;         // d: 512 (main) or 128 (indexer, ratio 4 only)
  bool indexer = false;  // true: Hadamard + MXFP4 into an indexer-key store (d = 128)

  // This chunk's projections, one row per token, rows of a sequence contiguous.
  const float* a = nullptr;  // wkv(x)   [num_tokens, >= coff*d], row stride a_stride floats
  const float* g = nullptr;  // wgate(x) [num_tokens, >= coff*d], row stride g_stride floats
  int64_t a_stride = 0, g_stride = 0;          // multiples of 4 (16-byte rows)
  const float* ape = nullptr;                  // [ratio, coff*d] fp32
  const __nv_bfloat16* norm_weight = nullptr;  // [d] compressor norm (BF16 as in the checkpoint)
  const float* inv_freq = nullptr;             // [32] the layer's compressed RoPE table (YaRN)
  float eps = 1e-6f;

  // Batch: sequence s owns token rows [cu_seqlens[s], cu_seqlens[s+1]) at positions
  // start_pos[s] + 0, 1, ...; its state is slot state_slot[s]; its entries go to block-table
  // row s of `store`. All device arrays.
  int num_seqs = 0;
  int num_tokens = 0;                   // cu_seqlens[num_seqs] (host copy)
  int max_seq_tokens = 0;               // max over s of the chunk length (host; picks the path)
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1]
  const int32_t* start_pos = nullptr;   // [num_seqs]
  const int32_t* state_slot = nullptr;  // [num_seqs], distinct
  float* states = nullptr;              // [slots, CompressorStateLayout{ratio, d}.floats()]
  PagedStoreView store{};               // KV store (584 B) or indexer-key store (68 B)

  CompressorPath path = CompressorPath::kAuto;
  // Programmatic dependent launch: the first kernel may start while the kernel before it on the
  // stream finishes (every kernel here waits in griddepcontrol.wait before its first global
  // access, and lets its successor launch at once); graph-capturable. The op's second kernel
  // (kSplit) always follows the first programmatically.
  bool pdl = false;
};

void compressor_forward(const CompressorParams& p, cudaStream_t stream = nullptr);

// A fresh sequence's state (HostCache::reset_states): kv rows 0, score rows -inf, for the
// `num_slots` slots listed in `slots` (device array) of a [slots, layout.floats()] pool.
void compressor_reset_states(float* states, const int32_t* slots, int num_slots, int ratio, int dim,
                             cudaStream_t stream = nullptr);

}  // namespace dsv4::cuda
