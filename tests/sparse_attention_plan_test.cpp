// The sparse-attention planner (ops/cuda/sparse_attention/sparse_attention_plan.h) on the CPU:
// its choices at the shapes of issue 17's table (H200: 132 SMs, 16384 tokens of context), and
// its cost model against the H200 figures sparse_attention_heuristics.h was fitted to.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/cuda/sparse_attention/sparse_attention_heuristics.h"
#include "ops/cuda/sparse_attention/sparse_attention_plan.h"

namespace dsv4 {
namespace {

using cuda::SparseAttnKernel;
using cuda::SparseAttnPlan;
using cuda::SparseAttnShape;

constexpr int kSms = 132;  // H200

// The shapes: 64-key blocks of the key list at 16384 tokens of context (window 128).
struct TableShape {
  const char* name;
  int heads, key_blocks;
};
const TableShape kShapes[] = {
    {"Flash CSA (window + top-512)", 64, (128 + 512) / 64},
    {"Flash HCA (128 entries)", 64, (128 + 16384 / 128) / 64},
    {"Flash HCA (1024 entries)", 64, (128 + 1024) / 64},
    {"Pro CSA (window + top-1024)", 128, (128 + 1024) / 64},
};

SparseAttnShape shape_of(const TableShape& t, int batch, int s_q) {
  SparseAttnShape s;
  s.num_tokens = batch * s_q;
  s.n_heads = t.heads;
  s.max_key_blocks = t.key_blocks;
  s.sm_count = kSms;
  return s;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

int64_t ctas(const SparseAttnShape& s, const SparseAttnPlan& p) {
  return int64_t(s.num_tokens) * ceil_div(s.n_heads, p.heads_per_cta) * p.num_splits;
}

std::string describe(const TableShape& t, int b, int s_q, const SparseAttnPlan& p) {
  return std::string(t.name) + " b=" + std::to_string(b) + " s_q " + std::to_string(s_q) + ": ht " +
         std::to_string(p.heads_per_cta) + " splits " + std::to_string(p.num_splits) +
         " blocks/split " + std::to_string(p.blocks_per_split);
}

// A plan is well formed: a tile the kernel has, splits that cover every key block exactly
// once with no empty trailing split.
void expect_consistent(const SparseAttnShape& s, const SparseAttnPlan& p, const std::string& what) {
  EXPECT_TRUE(p.heads_per_cta == 16 || p.heads_per_cta == 32 || p.heads_per_cta == 64) << what;
  EXPECT_EQ(p.max_key_blocks, s.max_key_blocks) << what;
  EXPECT_GE(p.num_splits, 1) << what;
  EXPECT_GE(int64_t(p.num_splits) * p.blocks_per_split, s.max_key_blocks) << what;
  EXPECT_LT(int64_t(p.num_splits - 1) * p.blocks_per_split, s.max_key_blocks) << what;
}

// Large batches: the split partials (2064 bytes per token, head and split, written then read
// back) and the combine cost more than the wave they would save, so at b >= 128 the plan keeps
// the key list whole or halves it at most (the issue: 9-18 splits there made these shapes
// 4-9x FlashMLA's time).
TEST(SparseAttentionPlan, LargeBatchesSplitAtMostTwice) {
  for (const TableShape& t : kShapes)
    for (int s_q : {1, 2})
      for (int b : {128, 256}) {
        const SparseAttnShape s = shape_of(t, b, s_q);
        const SparseAttnPlan p = cuda::plan_sparse_attention(s);
        const std::string what = describe(t, b, s_q, p);
        expect_consistent(s, p, what);
        EXPECT_LE(p.num_splits, 2) << what;
        // Whenever the 64-head tiles alone fill the GPU (tokens x tiles >= SMs), splitting
        // only adds waves: exactly one split.
        if (int64_t(s.num_tokens) * ceil_div(t.heads, 64) >= kSms) {
          EXPECT_EQ(p.num_splits, 1) << what;
          EXPECT_EQ(p.heads_per_cta, 64) << what << " (each key block decoded for 64 heads)";
        }
      }
}

// Small batches: 2-4 query tokens cannot fill 132 SMs with head tiles alone, so the plan
// splits the keys until the grid fills the GPU: one wave, with at least half the SMs busy or
// every CTA down to a single key block.
TEST(SparseAttentionPlan, SmallBatchesSplitToFillTheGpu) {
  for (const TableShape& t : kShapes)
    for (int s_q : {1, 2}) {
      const SparseAttnShape s = shape_of(t, 2, s_q);
      const SparseAttnPlan p = cuda::plan_sparse_attention(s);
      const std::string what = describe(t, 2, s_q, p);
      expect_consistent(s, p, what);
      EXPECT_GE(p.num_splits, 4) << what;
      EXPECT_LE(ctas(s, p), kSms) << what << ": one wave";
      EXPECT_TRUE(ctas(s, p) >= kSms / 2 || p.blocks_per_split == 1) << what;
    }
}

// Hand-derived from the model: Flash CSA b=2 s_q 1 has 10 key blocks; 16-head tiles give 8
// (token, tile) units, and 10 splits of one block each make 80 CTAs, one wave:
//   10 (launch) + 3 + 3.55 (one block at ht 16) + 1.45 (partials) + 2 + 0.92 (combine) = 20.9
// against 2 blocks (5 splits) 24.5 and 64-head tiles (2 units) 10 + 3 + 7.6 + 5.8 + 2.9 = 29.
TEST(SparseAttentionPlan, FlashCsaBatch2OneBlockPerCta) {
  const SparseAttnShape s = shape_of(kShapes[0], 2, 1);
  const SparseAttnPlan p = cuda::plan_sparse_attention(s);
  EXPECT_EQ(p.heads_per_cta, 16);
  EXPECT_EQ(p.num_splits, 10);
  EXPECT_EQ(p.blocks_per_split, 1);
  EXPECT_NEAR(cuda::sparse_attention_model_us(s, p), 20.9, 0.1);
}

// The example: Flash CSA s_q 2 at b=256 went from 1 split at b=128 (166 µs) to 10
// (1183 µs). 512 tokens x 1 tile = 512 units (now the staged wgmma kernel's): 1 split is 4
// waves of 10 blocks, 10 + 4 x (3 + 46) = 206 µs; 10 splits are 39 waves of one block plus
// 1 GB of partials.
TEST(SparseAttentionPlan, FlashCsaSq2Batch256KeepsOneSplit) {
  const SparseAttnShape s = shape_of(kShapes[0], 256, 2);
  const SparseAttnPlan p = cuda::plan_sparse_attention(s);
  EXPECT_EQ(p.num_splits, 1);
  EXPECT_EQ(p.heads_per_cta, 64);
  EXPECT_EQ(p.kernel, SparseAttnKernel::kWgmma);
  EXPECT_NEAR(cuda::sparse_attention_model_us(s, p), 206.0, 0.5);
  SparseAttnShape forced = s;
  forced.num_splits = 10;
  const SparseAttnPlan p10 = cuda::plan_sparse_attention(forced);
  EXPECT_EQ(p10.num_splits, 10);
  // Measured 1183 / (2 x 166): the model must rank them the same way, by a wide margin.
  EXPECT_GT(cuda::sparse_attention_model_us(forced, p10),
            2.5 * cuda::sparse_attention_model_us(s, p));
}

// Fewer splits (never more) as the batch grows, at every shape of the table.
TEST(SparseAttentionPlan, SplitsFallAsTheBatchGrows) {
  for (const TableShape& t : kShapes)
    for (int s_q : {1, 2}) {
      int prev = 1 << 30;
      for (int b : {1, 2, 4, 8, 16, 32, 64, 128, 256, 512}) {
        const SparseAttnPlan p = cuda::plan_sparse_attention(shape_of(t, b, s_q));
        EXPECT_LE(p.num_splits, prev) << describe(t, b, s_q, p);
        prev = p.num_splits;
      }
    }
}

// Prefill (4096 query tokens): thousands of units fill the GPU many times over: one split,
// 64-head tiles (the old planner chose 10 splits here: 6.7 ms against FlashMLA's 0.65).
TEST(SparseAttentionPlan, PrefillNeverSplits) {
  for (const TableShape& t : kShapes) {
    SparseAttnShape s = shape_of(t, 1, 4096);
    const SparseAttnPlan p = cuda::plan_sparse_attention(s);
    EXPECT_EQ(p.num_splits, 1) << describe(t, 1, 4096, p);
    EXPECT_EQ(p.heads_per_cta, 64) << describe(t, 1, 4096, p);
  }
}

// The cost model against the H200 figures it was fitted to (sparse_attention_heuristics.h,
// from bench/results/kernels-h200.md, mma kernel): within 25 % at every one, so a change of a
// constant that breaks the fit shows here.
TEST(SparseAttentionPlan, ModelMatchesTheMeasuredFigures) {
  struct Point {
    const char* what;
    int tokens, heads, key_blocks, ht, splits;
    double measured_us;
  };
  const Point points[] = {
      {"Flash CSA b=128 s_q 1", 128, 64, 10, 64, 1, 89.73},
      {"Flash CSA b=128 s_q 2", 256, 64, 10, 64, 1, 164.61},
      {"Flash HCA b=128 s_q 1", 128, 64, 4, 64, 1, 44.42},
      {"Flash HCA b=128 s_q 2", 256, 64, 4, 64, 1, 79.01},
      {"Flash CSA b=2 s_q 1", 2, 64, 10, 16, 10, 21.57},
      {"Flash CSA b=2 s_q 2", 4, 64, 10, 16, 5, 23.42},
      {"Flash HCA b=2 s_q 1", 2, 64, 4, 16, 4, 17.82},
      {"Pro CSA b=2 s_q 1", 2, 128, 18, 16, 6, 28.93},
      {"Pro CSA b=2 s_q 2", 4, 128, 18, 16, 4, 38.59},
      {"Pro CSA b=128 s_q 1", 128, 128, 18, 64, 18, 788.96},
      {"Pro CSA b=128 s_q 2", 256, 128, 18, 64, 9, 1021.22},
      {"Flash CSA prefill s_q 4096", 4096, 64, 10, 64, 10, 6713.34},
  };
  // wgmma (2026-12-02): unpaired at 64 heads, CTA pairs at 128; the staged producer (13:07
  // run) and the previous one (kWgmmaDirect, 09:40 run); the staged producer without pairs at
  // 128 heads (kWgmmaUnpaired, 6bd838c).
  struct KernelPoint {
    SparseAttnKernel kernel;
    Point pt;
  };
  const SparseAttnKernel kW = SparseAttnKernel::kWgmma, kD = SparseAttnKernel::kWgmmaDirect,
                         kU = SparseAttnKernel::kWgmmaUnpaired;
  const KernelPoint wgmma_points[] = {
      {kU, {"unpaired Pro CSA b=128 s_q 1", 128, 128, 18, 64, 1, 158.7}},
      {kU, {"unpaired Pro CSA b=128 s_q 2", 256, 128, 18, 64, 1, 311.2}},
      {kW, {"wgmma Flash CSA b=128 s_q 1", 128, 64, 10, 64, 1, 58.1}},
      {kW, {"wgmma Flash CSA b=128 s_q 2", 256, 64, 10, 64, 1, 106.9}},
      {kW, {"wgmma Flash HCA b=128 s_q 1", 128, 64, 4, 64, 1, 37.4}},
      {kW, {"wgmma Flash HCA b=128 s_q 2", 256, 64, 4, 64, 1, 64.2}},
      {kW, {"wgmma Pro CSA b=128 s_q 1", 128, 128, 18, 64, 1, 227.2}},
      {kW, {"wgmma Pro CSA b=128 s_q 2", 256, 128, 18, 64, 1, 442.2}},
      {kD, {"direct Flash CSA b=128 s_q 1", 128, 64, 10, 64, 1, 97.22}},
      {kD, {"direct Flash CSA b=128 s_q 2", 256, 64, 10, 64, 1, 189.15}},
      {kD, {"direct Pro CSA b=128 s_q 1", 128, 128, 18, 64, 1, 241.7}},
      {kD, {"direct Pro CSA b=128 s_q 2", 256, 128, 18, 64, 1, 470.27}},
      // Prefill, s_q 4096 at 8K context (2026-12-04).
      {kW, {"wgmma Flash CSA prefill s_q 4096", 4096, 64, 10, 64, 1, 1408.0}},
      {kU, {"unpaired Pro CSA prefill s_q 4096", 4096, 128, 18, 64, 1, 4456.7}},
  };
  for (const KernelPoint& kp : wgmma_points) {
    const Point& pt = kp.pt;
    SparseAttnShape s;
    s.num_tokens = pt.tokens;
    s.n_heads = pt.heads;
    s.max_key_blocks = pt.key_blocks;
    s.sm_count = kSms;
    s.kernel = kp.kernel;
    s.num_splits = pt.splits;
    const SparseAttnPlan p = cuda::plan_sparse_attention(s);
    ASSERT_EQ(p.kernel, kp.kernel) << pt.what;
    const double model = cuda::sparse_attention_model_us(s, p);
    EXPECT_LT(std::fabs(model / pt.measured_us - 1.0), 0.25)
        << pt.what << ": model " << model << " µs, measured " << pt.measured_us;
  }
  // kWgmmaPredecoded at prefill (2026-12-04), its decode pass over the launch's key rows
  // (tokens + window + every visible compressed entry) included.
  struct PrePoint {
    Point pt;
    int64_t rows;
  };
  const PrePoint pre_points[] = {
      {{"predecoded Flash CSA prefill s_q 4096", 4096, 64, 10, 64, 1, 902.9}, 4096 + 128 + 2048},
      {{"predecoded Flash CSA prefill s_q 8192", 8192, 64, 10, 64, 1, 1822.5}, 8192 + 128 + 4096},
      {{"predecoded Pro CSA prefill s_q 4096", 4096, 128, 18, 64, 1, 2899.9}, 4096 + 128 + 2048},
      {{"predecoded Pro CSA prefill s_q 8192", 8192, 128, 18, 64, 1, 5773.7}, 8192 + 128 + 4096},
  };
  for (const PrePoint& pp : pre_points) {
    SparseAttnShape s;
    s.num_tokens = pp.pt.tokens;
    s.n_heads = pp.pt.heads;
    s.max_key_blocks = pp.pt.key_blocks;
    s.sm_count = kSms;
    s.kernel = SparseAttnKernel::kWgmmaPredecoded;
    s.num_splits = pp.pt.splits;
    s.predecode_rows = pp.rows;
    const SparseAttnPlan p = cuda::plan_sparse_attention(s);
    ASSERT_EQ(p.kernel, SparseAttnKernel::kWgmmaPredecoded) << pp.pt.what;
    const double model = cuda::sparse_attention_model_us(s, p);
    EXPECT_LT(std::fabs(model / pp.pt.measured_us - 1.0), 0.25)
        << pp.pt.what << ": model " << model << " µs, measured " << pp.pt.measured_us;
  }
  for (const Point& pt : points) {
    SparseAttnShape s;
    s.num_tokens = pt.tokens;
    s.n_heads = pt.heads;
    s.max_key_blocks = pt.key_blocks;
    s.sm_count = kSms;
    s.kernel = SparseAttnKernel::kMma;
    s.heads_per_cta = pt.ht;
    s.num_splits = pt.splits;
    const SparseAttnPlan p = cuda::plan_sparse_attention(s);
    ASSERT_EQ(p.heads_per_cta, pt.ht) << pt.what;
    ASSERT_EQ(p.num_splits, pt.splits) << pt.what;
    const double model = cuda::sparse_attention_model_us(s, p);
    EXPECT_LT(std::fabs(model / pt.measured_us - 1.0), 0.25)
        << pt.what << ": model " << model << " µs, measured " << pt.measured_us;
  }
}

// The kernel follows the measured table: mma below 128 tokens; the staged wgmma from 128 to
// 1024 decode tokens and at prefill, where it was measured faster — without CTA pairs at 128
// heads, where the unpaired CTAs beat the pairs.
TEST(SparseAttentionPlan, KernelFollowsTheMeasuredTable) {
  for (const TableShape& t : kShapes)
    for (int b : {1, 2, 64, 128, 256}) {
      const SparseAttnPlan p = cuda::plan_sparse_attention(shape_of(t, b, 1));
      const SparseAttnKernel want = b < 128          ? SparseAttnKernel::kMma
                                    : t.heads == 128 ? SparseAttnKernel::kWgmmaUnpaired
                                                     : SparseAttnKernel::kWgmma;
      EXPECT_EQ(p.kernel, want) << describe(t, b, 1, p);
    }
  // Without wgmma (another GPU) every shape falls back to mma.
  for (const TableShape& t : kShapes) {
    SparseAttnShape s = shape_of(t, 128, 1);
    s.wgmma_available = false;
    EXPECT_EQ(cuda::plan_sparse_attention(s).kernel, SparseAttnKernel::kMma) << t.name;
  }
  for (const TableShape& t : kShapes)
    EXPECT_EQ(cuda::plan_sparse_attention(shape_of(t, 1, 4096)).kernel,
              t.heads == 128 ? SparseAttnKernel::kWgmmaUnpaired : SparseAttnKernel::kWgmma)
        << t.name << " prefill";
  SparseAttnShape s = shape_of(kShapes[0], 2, 1);
  s.kernel = SparseAttnKernel::kWgmma;
  const SparseAttnPlan p = cuda::plan_sparse_attention(s);
  EXPECT_EQ(p.kernel, SparseAttnKernel::kWgmma);
  EXPECT_EQ(p.heads_per_cta, 64);
  EXPECT_GE(p.num_splits, 2);  // 2 units: splits still fill the GPU
}

// kAuto takes the predecoded keys for a prefill launch whose key rows fit the workspace the
// caller offers, and not without the offer, one byte short of it, at decode (where the pass
// would decode whole contexts for a token or two each) or without wgmma.
TEST(SparseAttentionPlan, PredecodedKeysForPrefillWithinTheOffer) {
  for (const TableShape& t : kShapes) {
    SparseAttnShape s = shape_of(t, 1, 4096);
    s.predecode_rows = 4096 + 128 + 2048;
    const SparseAttnKernel staged =
        t.heads == 128 ? SparseAttnKernel::kWgmmaUnpaired : SparseAttnKernel::kWgmma;
    EXPECT_EQ(cuda::plan_sparse_attention(s).kernel, staged) << t.name << ": nothing offered";
    s.workspace_offered = 64ll << 20;
    SparseAttnPlan p = cuda::plan_sparse_attention(s);
    EXPECT_EQ(p.kernel, SparseAttnKernel::kWgmmaPredecoded) << describe(t, 1, 4096, p);
    const int64_t need = cuda::sparse_attention_workspace(s, p).total();
    EXPECT_EQ(need, s.predecode_rows * 1024) << t.name;
    s.workspace_offered = need;
    EXPECT_EQ(cuda::plan_sparse_attention(s).kernel, SparseAttnKernel::kWgmmaPredecoded);
    s.workspace_offered = need - 1;
    EXPECT_EQ(cuda::plan_sparse_attention(s).kernel, staged) << t.name << ": one byte short";
    s.workspace_offered = 64ll << 20;
    s.wgmma_available = false;
    EXPECT_EQ(cuda::plan_sparse_attention(s).kernel, SparseAttnKernel::kMma) << t.name;

    // Decode, batch 128 at 16K: the pass would decode every sequence's whole context.
    SparseAttnShape d = shape_of(t, 128, 1);
    d.predecode_rows = 128 + 128 * (128 + 4096);
    d.num_seqs = 128;
    d.workspace_offered = int64_t(1) << 40;
    EXPECT_EQ(cuda::plan_sparse_attention(d).kernel, staged) << t.name << " decode";
    // Short contexts, where the model alone might take it: decode launches never do.
    d.predecode_rows = 128 + 128 * (128 + 16);
    EXPECT_EQ(cuda::plan_sparse_attention(d).kernel, staged) << t.name << " short decode";
    d.kernel = SparseAttnKernel::kWgmmaPredecoded;  // forced: kept
    EXPECT_EQ(cuda::plan_sparse_attention(d).kernel, SparseAttnKernel::kWgmmaPredecoded);
  }
}

// Overrides are kept; the rest is chosen around them. A forced count that would leave a
// trailing split empty becomes the count that covers the blocks evenly (7 of 10 blocks: 2 per
// split, 5 splits); more splits than blocks give one block each.
TEST(SparseAttentionPlan, OverridesAreKept) {
  SparseAttnShape s = shape_of(kShapes[0], 128, 1);
  s.heads_per_cta = 16;
  SparseAttnPlan p = cuda::plan_sparse_attention(s);
  EXPECT_EQ(p.heads_per_cta, 16);
  s.num_splits = 7;
  p = cuda::plan_sparse_attention(s);
  EXPECT_EQ(p.num_splits, 5);
  EXPECT_EQ(p.blocks_per_split, 2);
  s.num_splits = 40;
  p = cuda::plan_sparse_attention(s);
  EXPECT_EQ(p.num_splits, 10);
  EXPECT_EQ(p.blocks_per_split, 1);
}

// Head counts below a tile: 4 and 8 heads run 16-row tiles; 32 heads never a 64-head tile.
TEST(SparseAttentionPlan, TilesFitTheHeadCount) {
  for (int heads : {4, 8, 16, 32, 48}) {
    for (int tokens : {1, 64, 4096}) {
      SparseAttnShape s;
      s.num_tokens = tokens;
      s.n_heads = heads;
      s.max_key_blocks = 10;
      s.sm_count = kSms;
      const SparseAttnPlan p = cuda::plan_sparse_attention(s);
      EXPECT_LE(p.heads_per_cta, std::max(16, heads)) << heads << " heads, " << tokens;
      EXPECT_EQ(p.kernel, SparseAttnKernel::kMma);
    }
  }
}

TEST(SparseAttentionPlan, RejectsABadShape) {
  SparseAttnShape s;
  s.num_tokens = 1;
  s.n_heads = 64;
  s.max_key_blocks = 10;
  s.sm_count = 0;
  EXPECT_THROW(cuda::plan_sparse_attention(s), Error);
}

}  // namespace
}  // namespace dsv4
