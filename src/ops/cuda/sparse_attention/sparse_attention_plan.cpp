// The sparse-attention launch planner (sparse_attention_plan.h): every candidate (heads per
// CTA, key splits) of the chosen kernel is costed with the model of
// sparse_attention_heuristics.h and the cheapest one is kept.
#include "ops/cuda/sparse_attention/sparse_attention_plan.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "ops/cuda/sparse_attention/sparse_attention_heuristics.h"

namespace dsv4::cuda {
namespace {

namespace h = sparse_attn_heuristics;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Rows of the heads-per-CTA tile the kernel computes (a tile never pads past the next 16).
int tile_rows(int n_heads, int ht) {
  return std::min(ht, std::max(16, int(ceil_div(n_heads, 16)) * 16));
}

double model_us(const SparseAttnShape& s, SparseAttnKernel kernel, int ht, int splits, int bps) {
  const int64_t units = int64_t(std::max(1, s.num_tokens)) * ceil_div(s.n_heads, ht);
  const int64_t waves = ceil_div(units * splits, std::max(1, s.sm_count));
  const int rows = tile_rows(s.n_heads, ht);
  // wgmma pairs the head tiles of a token (one gather per key block) when n_heads % 128 == 0.
  const bool pairs = s.n_heads % 128 == 0 && kernel != SparseAttnKernel::kWgmmaUnpaired &&
                     kernel != SparseAttnKernel::kWgmmaPredecoded;
  const h::BlockCost& bc =
      kernel == SparseAttnKernel::kWgmmaPredecoded ? h::kWgmmaPredecodedBlockCost
      : kernel == SparseAttnKernel::kWgmma || kernel == SparseAttnKernel::kWgmmaUnpaired
          ? (pairs ? h::kWgmmaPairBlockCost : h::kWgmmaBlockCost)
      : kernel == SparseAttnKernel::kWgmmaDirect
          ? (pairs ? h::kWgmmaDirectPairBlockCost : h::kWgmmaDirectBlockCost)
          : h::kMmaBlockCost;
  const double block_us = bc.base_us + bc.per16_us * rows / 16.0;
  double cta_us = h::kCtaFixedUs + bps * block_us;
  double us = h::kLaunchUs;
  if (kernel == SparseAttnKernel::kWgmmaPredecoded)  // the decode pass before the kernel
    us += h::kPredecodeLaunchUs +
          double(s.predecode_rows) * h::kPredecodeBytesPerRow / h::kHbmBytesPerUs;
  if (splits > 1) {
    cta_us += rows * h::kPartialBytes / (h::kHbmBytesPerUs / std::max(1, s.sm_count));
    const double rows_total = double(std::max(1, s.num_tokens)) * s.n_heads;
    us += h::kCombineLaunchUs +
          rows_total * (splits * h::kPartialBytes + h::kOutBytes) / h::kHbmBytesPerUs;
  }
  return us + double(waves) * cta_us;
}

}  // namespace

SparseAttnKernel sparse_attention_auto_kernel(const SparseAttnShape& s) {
  const int tokens = std::max(1, s.num_tokens);
  for (const h::KernelRule& r : h::kKernelTable)
    if (s.n_heads % r.heads_multiple == 0 && tokens >= r.min_tokens && tokens <= r.max_tokens) {
      if (is_wgmma(r.kernel) && !s.wgmma_available) continue;
      return r.kernel;
    }
  return SparseAttnKernel::kMma;
}

namespace {

// The cheapest tile and split count for `kernel` (its model time in *best_us).
SparseAttnPlan plan_for(const SparseAttnShape& s, SparseAttnKernel kernel, double* best_us) {
  SparseAttnPlan plan;
  plan.kernel = kernel;
  plan.max_key_blocks = s.max_key_blocks;
  const int nblk = std::max(1, s.max_key_blocks);
  std::vector<int> tiles;
  if (s.heads_per_cta != 0)
    tiles = {s.heads_per_cta};
  else if (is_wgmma(plan.kernel))
    tiles = {64};
  else  // largest first: ties go to the tile that decodes each key block for the most heads
    for (int ht : {64, 32, 16})
      if (ht == 16 || ht <= ceil_div(s.n_heads, 16) * 16) tiles.push_back(ht);

  double best = 0;
  bool have = false;
  for (int ht : tiles) {
    const int lo = s.num_splits > 0 ? s.num_splits : 1;
    const int hi = s.num_splits > 0 ? s.num_splits : nblk;
    for (int splits = lo; splits <= hi; ++splits) {
      const int clamped = std::clamp(splits, 1, nblk);
      const int bps = int(ceil_div(nblk, clamped));
      const int eff = int(ceil_div(nblk, bps));
      if (s.num_splits == 0 && eff != splits) continue;  // the same split as a smaller count
      const double us = model_us(s, plan.kernel, ht, eff, bps);
      if (!have || us < best - 1e-9) {
        have = true;
        best = us;
        plan.heads_per_cta = ht;
        plan.num_splits = eff;
        plan.blocks_per_split = bps;
      }
    }
  }
  *best_us = best;
  return plan;
}

}  // namespace

SparseAttnWorkspace sparse_attention_workspace(const SparseAttnShape& s,
                                               const SparseAttnPlan& plan) {
  SparseAttnWorkspace w;
  if (plan.num_splits > 1)
    w.partial_bytes =
        int64_t(s.num_tokens) * s.n_heads * plan.num_splits * int64_t(h::kPartialBytes);
  if (plan.kernel == SparseAttnKernel::kWgmmaPredecoded) {
    w.keys_offset = (w.partial_bytes + 255) / 256 * 256;
    w.keys_bytes = s.predecode_rows * h::kKeyRowBytes;
  }
  return w;
}

SparseAttnPlan plan_sparse_attention(const SparseAttnShape& s) {
  DSV4_CHECK(s.n_heads > 0 && s.sm_count > 0 && s.max_key_blocks >= 0 && s.num_tokens >= 0 &&
                 s.predecode_rows >= 0,
             "sparse_attention plan: bad shape (heads ", s.n_heads, ", SMs ", s.sm_count,
             ", key blocks ", s.max_key_blocks, ", tokens ", s.num_tokens, ")");
  const SparseAttnKernel kernel =
      s.kernel == SparseAttnKernel::kAuto ? sparse_attention_auto_kernel(s) : s.kernel;
  double us = 0;
  SparseAttnPlan plan = plan_for(s, kernel, &us);
  if (s.kernel == SparseAttnKernel::kAuto && is_wgmma(kernel) && s.predecode_rows > 0 &&
      int64_t(s.num_tokens) >= int64_t(h::kPredecodeMinTokensPerSeq) * std::max(1, s.num_seqs)) {
    double pre_us = 0;
    const SparseAttnPlan pre = plan_for(s, SparseAttnKernel::kWgmmaPredecoded, &pre_us);
    if (pre_us < us && sparse_attention_workspace(s, pre).total() <= s.workspace_offered)
      plan = pre;
  }
  return plan;
}

double sparse_attention_model_us(const SparseAttnShape& s, const SparseAttnPlan& plan) {
  return model_us(s, plan.kernel, plan.heads_per_cta, plan.num_splits, plan.blocks_per_split);
}

}  // namespace dsv4::cuda
