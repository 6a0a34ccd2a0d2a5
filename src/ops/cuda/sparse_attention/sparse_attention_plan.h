// The sparse-attention launch planner: which kernel, heads per CTA and key splits a launch
// uses, as a pure function of the launch's shape and the GPU's SM count (no CUDA calls, so
// tests/sparse_attention_plan_test.cpp checks its choices on the CPU). The data it decides by
// lives in sparse_attention_heuristics.h.
#pragma once

#include <cstdint>

namespace dsv4::cuda {

enum class SparseAttnKernel {
  kAuto,   // the heuristic table's choice (sparse_attention_heuristics.h)
  kMma,    // mma.sync m16n8k16 kernel: every head count (4, 8, 16, 32, 64, 128), tiles of 16-64
           // heads without padding past the next 16
  kWgmma,  // Hopper wgmma kernel, warp-specialised (producer decodes FP8 while two warpgroups
           // run the MMAs): n_heads a multiple of 64; its producer stages the raw entries in
           // shared memory with asynchronous copies two blocks ahead of the decode
  kWgmmaDirect,    // the same kernel with the previous producer (entries loaded into registers,
                   // two BF16 K tiles): kept for the side-by-side benchmark, never chosen by kAuto
  kWgmmaUnpaired,  // kWgmma without CTA pairs at n_heads % 128 == 0 (every 64-head CTA gathers
                   // and decodes its whole key block): kAuto's choice for 128-head decode
                   // (measured faster than the pairs); kWgmma keeps the pairs there
  kWgmmaPredecoded,  // prefill: every key the launch can read decoded to BF16 once, into the
                     // workspace (a pass before the kernel), and the wgmma kernel's producer
                     // copying those rows (cp.async) into two K tiles; no CTA pairs. Bit for bit
                     // the kWgmmaUnpaired kernel's output (the same K tiles, the same consumers)
};

// The wgmma kernel in either producer variant.
constexpr bool is_wgmma(SparseAttnKernel k) {
  return k == SparseAttnKernel::kWgmma || k == SparseAttnKernel::kWgmmaDirect ||
         k == SparseAttnKernel::kWgmmaUnpaired || k == SparseAttnKernel::kWgmmaPredecoded;
}

// What a launch will do: kernel, heads per CTA, key splits (1 = no combine pass).
struct SparseAttnPlan {
  SparseAttnKernel kernel = SparseAttnKernel::kMma;
  int heads_per_cta = 0;
  int num_splits = 1;
  int blocks_per_split = 0;  // 64-key blocks per split
  int max_key_blocks = 0;    // 64-key blocks of the longest key list
};

// The shape of one launch as the planner sees it (sparse_attention.cpp fills it from the
// validated SparseAttnParams).
struct SparseAttnShape {
  int num_tokens = 0;      // query tokens of the launch
  int n_heads = 0;         // 4, 8 or a multiple of 16
  int max_key_blocks = 0;  // 64-key blocks of the longest key list (window + compressed)
  int sm_count = 0;        // SMs of the GPU (132 on the H200)
  bool wgmma_available = true;
  // kWgmmaPredecoded: the BF16 key rows it would decode (every key the launch's queries can
  // read: sparse_attention_predecode.cu), and the workspace the caller offers. kAuto weighs it
  // against the table's wgmma kernel only when its rows (and any split partials) fit the offer.
  // Only prefill-like launches take it (at least kPredecodeMinTokensPerSeq query tokens per
  // sequence, sparse_attention_heuristics.h).
  int num_seqs = 1;
  int64_t predecode_rows = 0;
  int64_t workspace_offered = 0;
  // Overrides (kAuto / 0: the planner chooses), for tests, benchmarks and the engine's
  // workspace cap; a forced value is kept and the others are chosen around it.
  SparseAttnKernel kernel = SparseAttnKernel::kAuto;
  int heads_per_cta = 0;  // 16, 32 or 64 (kMma); 64 (kWgmma, kWgmmaDirect)
  int num_splits = 0;
};

// The plan of least modelled time (ties: larger head tiles, then fewer splits). kAuto: the
// heuristic table's kernel, or kWgmmaPredecoded where that is a wgmma kernel, the predecoded
// rows fit the workspace offered and its model (the decode pass included) is faster.
SparseAttnPlan plan_sparse_attention(const SparseAttnShape& shape);

// Workspace bytes of a plan: the split partials, then (kWgmmaPredecoded) the BF16 key rows.
struct SparseAttnWorkspace {
  int64_t partial_bytes = 0, keys_offset = 0, keys_bytes = 0;
  int64_t total() const { return keys_bytes == 0 ? partial_bytes : keys_offset + keys_bytes; }
};
SparseAttnWorkspace sparse_attention_workspace(const SparseAttnShape& shape,
                                               const SparseAttnPlan& plan);

// The cost model's estimate of a plan's time in µs (kernel + combine), for tests and for the
// benchmark to print beside the measured time.
double sparse_attention_model_us(const SparseAttnShape& shape, const SparseAttnPlan& plan);

// The kernel kAuto resolves to for this shape (the heuristic table's row).
SparseAttnKernel sparse_attention_auto_kernel(const SparseAttnShape& shape);

}  // namespace dsv4::cuda
