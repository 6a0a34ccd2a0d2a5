// Which GEMM kernel and which work split for a shape (host-side, no device calls): kept apart
// from the kernels so the choices can be read, tested and tuned in one place.
//
// The choices come from one time model of the streaming kernel (StreamCostModel), fitted to the
// H200 rows of bench/results/kernels-h200.md, and a rough one of the tensor-core kernel:
//  * K split of a launch: the split whose predicted time is nearest the best at every token
//    width (8 and 64, the least and most work per K step), so one weight keeps one split, and
//    one fp32 summation order, at every m (a token's output does not depend on its batch);
//  * grouping: weights that read the same input share one launch where that launch is predicted
//    no slower than their own launches at 8 tokens (the one launch saved counted for them);
//  * path: m <= 64 streams; above, the tensor-core kernel, except that up to 256 rows a weight
//    the tensor-core kernel cannot take (n not a multiple of 8) streams in blocks of 64 tokens.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ops/cuda/gemm/fp8_gemm.h"
#include "ops/cuda/gemm/fp8_gemm_config.h"

namespace dsv4::cuda {

// Work split of the streaming kernel: `tiles` CTAs along N (128 weight rows each; a grouped
// launch counts the tiles of every weight) times `splits` CTAs along K (one cluster per tile,
// reduced through distributed shared memory in rank order: deterministic for a given split),
// times ceil(m / 64) token blocks above 64 tokens.
struct StreamPlan {
  int tokens = 0;   // wgmma N: m padded to 8/16/32/64 (64 for every block above 64)
  int tiles = 0;    // sum over the weights of ceil(n / 128)
  int splits = 1;   // cluster size along K, 1..kStreamMaxSplits, <= k_steps
  int k_steps = 0;  // 128-byte K steps per weight row
};

// What the device can hold at once, per cluster size s (from cudaOccupancyMaxActiveClusters,
// measured once per device and kernel variant by the launcher): resident[s] CTAs in clusters of
// s; max_splits is the largest s up to which the device places every size (16 needs the
// non-portable cluster size, which a GPC too small for it refuses).
struct StreamResidency {
  int max_splits = gemm_cfg::kStreamPortableSplits;
  int resident[gemm_cfg::kStreamMaxSplits + 1] = {};
};
// Without a device's figures: kStreamCtasPerSm CTAs on every SM, portable clusters only.
inline StreamResidency default_residency(int sm_count) {
  StreamResidency r;
  const int slots = std::max(1, sm_count) * gemm_cfg::kStreamCtasPerSm;
  for (int s = 1; s <= gemm_cfg::kStreamMaxSplits; ++s) r.resident[s] = slots / s * s;
  return r;
}
// A device like the H200 without its measured figures (132 SMs, two CTAs each, clusters up to
// 16 placed everywhere): what the tests plan with.
constexpr int kReferenceSms = 132;
inline StreamResidency reference_residency() {
  StreamResidency r = default_residency(kReferenceSms);
  r.max_splits = gemm_cfg::kStreamMaxSplits;
  return r;
}

// Time model of the streaming kernel in µs, the launch itself left out. CTAs run in waves of
// the resident count; a wave costs a start-up (CTA launch, barrier set-up, first TMA round trip,
// epilogue) plus its K steps, each bound either by one CTA's own chain (wait for the stage, the
// wgmma slices, their promotion: step_us by token width) or by HBM shared by the wave's CTAs
// (token blocks of one tile share its bytes through L2); a K split adds its cluster barriers and
// the DSMEM reduction. Fitted (scripts/fit_stream_gemm_model.py, HBM fixed at the anchors'
// 4.3 TB/s) to the 18 streaming rows of 740a4a4 (bench/results/kernels-h200.md: every Flash
// weight at m = 1 and 64, graph replays with ~5.6 µs of launch around each), within 11 % rms;
// that kernel's reduction also cost ~0.09 µs per token in series at every split above 1 (5.8 µs
// at m = 64), which the reduction since removes and the model no longer has.
struct StreamCostModel {
  double hbm_bytes_per_us = 4.3e6;             // 4.3 TB/s sustained by a full wave
  double wave_start_us = 2.3;                  // per wave of CTAs
  double step_us[4] = {0.19, 0.46, 1.0, 2.1};  // one K step, chain-bound, 8/16/32/64 tokens
  double split_us = 0.5;                       // a split's cluster barriers
  double split_rank_us = 0.04;                 // ... and reduction, per rank
  double launch_us = 2.0;                      // one more kernel launch (graph, PDL chain)
};

inline int stream_width_index(int tokens) {
  return tokens <= 8 ? 0 : tokens <= 16 ? 1 : tokens <= 32 ? 2 : 3;
}

// Predicted time (µs) of `tiles` weight tiles of `k_steps` K steps at `splits`, `token_blocks`
// blocks of `tokens` tokens; a huge figure where the device places no cluster of that size.
inline double stream_time_us(int tiles, int k_steps, int splits, int token_blocks, int tokens,
                             const StreamResidency& res, const StreamCostModel& c = {}) {
  const int slots = res.resident[splits];
  if (splits < 1 || splits > res.max_splits || slots < splits) return 1e30;
  const int64_t ctas = int64_t(tiles) * splits * token_blocks;
  const int per = (k_steps + splits - 1) / splits;
  const double chain = per * c.step_us[stream_width_index(tokens)];
  const double step_bytes = double(gemm_cfg::kStreamRows) * gemm_cfg::kStreamStepBytes;
  const auto wave = [&](int64_t n) {
    const double bytes = double(n) / token_blocks * per * step_bytes;
    return c.wave_start_us + std::max(chain, bytes / c.hbm_bytes_per_us);
  };
  const int64_t full = ctas / slots, rem = ctas % slots;
  double t = double(full) * wave(slots) + (rem > 0 ? wave(rem) : 0.0);
  if (splits > 1) t += c.split_us + c.split_rank_us * splits;
  return t;
}

// The K split for `tiles` tiles of `k_steps` steps: the split whose predicted time is within
// the least factor of the best split's at both 8 and 64 tokens (ties: the smaller split). It
// does not depend on m, so a weight's summation order is the same at every batch size.
inline StreamPlan plan_stream_tiles(int m, int tiles, int k_steps, const StreamResidency& res,
                                    const StreamCostModel& c = {}) {
  StreamPlan p;
  p.tokens = gemm_cfg::stream_tokens(std::min(m, gemm_cfg::kStreamMaxTokens));
  p.tiles = tiles;
  p.k_steps = k_steps;
  const int top = std::min({gemm_cfg::kStreamMaxSplits, res.max_splits, k_steps});
  double best8 = 1e30, best64 = 1e30;
  for (int s = 1; s <= top; ++s) {
    best8 = std::min(best8, stream_time_us(tiles, k_steps, s, 1, 8, res, c));
    best64 = std::min(best64, stream_time_us(tiles, k_steps, s, 1, 64, res, c));
  }
  double best = 1e30;
  for (int s = 1; s <= top; ++s) {
    const double t8 = stream_time_us(tiles, k_steps, s, 1, 8, res, c);
    const double t64 = stream_time_us(tiles, k_steps, s, 1, 64, res, c);
    if (t8 >= 1e29) continue;  // the device places no cluster of this size
    const double regret = std::max(t8 / best8, t64 / best64);
    if (regret < best - 1e-9) {
      best = regret;
      p.splits = s;
    }
  }
  return p;
}

inline StreamPlan plan_stream(int m, int n, int k_steps, int sm_count) {
  return plan_stream_tiles(m, (n + gemm_cfg::kStreamRows - 1) / gemm_cfg::kStreamRows, k_steps,
                           default_residency(sm_count));
}

// Whether `count` weights of `k_steps` K steps that read the same input (tiles[g] tiles each)
// should share one streaming launch: its plan's predicted time at 8 tokens is no more than the
// weights' own plans' times added up with one launch per further weight. Grouping changes only
// which split each weight gets, so the rule is as m-independent as the plans. At 8 tokens only:
// the model's 64-token figures held wq_b + indexer wq_b apart, which the H200 contradicted (one
// launch 19.8 / 43.7 µs against 21.6 / 46.0 at m = 1 / 64; V4-Pro 39.2 / 82.0 against 41.0 /
// 84.2); the 64-token times are still reported.
struct StreamGrouping {
  bool grouped = true;
  double grouped_us[2] = {};   // at 8 and 64 tokens
  double separate_us[2] = {};  // the same, the weights' own launches added up
};
inline StreamGrouping plan_stream_grouping(const int* tiles, int count, int k_steps,
                                           const StreamResidency& res,
                                           const StreamCostModel& c = {}) {
  StreamGrouping g;
  int all = 0;
  for (int i = 0; i < count; ++i) all += tiles[i];
  const int widths[2] = {8, 64};
  const StreamPlan together = plan_stream_tiles(1, all, k_steps, res, c);
  for (int w = 0; w < 2; ++w) {
    g.grouped_us[w] = stream_time_us(all, k_steps, together.splits, 1, widths[w], res, c);
    g.separate_us[w] = c.launch_us * (count - 1);
    for (int i = 0; i < count; ++i) {
      const StreamPlan own = plan_stream_tiles(1, tiles[i], k_steps, res, c);
      g.separate_us[w] += stream_time_us(tiles[i], k_steps, own.splits, 1, widths[w], res, c);
    }
  }
  g.grouped = count == 1 || g.grouped_us[0] <= g.separate_us[0];
  return g;
}

// Decode-sized problems stream the weights; larger ones go to the tensor-core GEMM, except that
// up to kStreamMaxM rows a weight whose n is not a multiple of 8 (which the tensor-core kernel
// cannot take) streams in blocks of 64 tokens. Streaming from 65 rows was measured against the
// tensor-core kernel on the H200 (gemm_bench, interim of 2026-12-02): ahead only at m = 65 for
// the smallest weights (Flash wq_a 18.2 µs against 21.3, wkv 15.9 against 20.8), behind from
// m = 128 (wq_a 24.9 / 21.6, wkv 24.5 / 21.2, shared w1|w3 28.6 / 21.2) and for every larger
// weight. A function of the shape alone (the verifier predicts the summation from it).
inline Fp8GemmPath fp8_gemm_pick_path(int m, int n, int /*k*/) {
  if (m <= gemm_cfg::kStreamMaxTokens) return Fp8GemmPath::kStream;
  if (m <= gemm_cfg::kStreamMaxM && n % 8 != 0) return Fp8GemmPath::kStream;
  return Fp8GemmPath::kTensorCore;
}

// The tensor-core kernel's persistent scheduler runs whole 128x128 output tiles; when there are
// fewer tiles than SMs (decode batches of 65..~512 rows, small N) stream-K splits K so that
// every SM works — except for up to two rows of tiles (m <= 256) with K up to
// kPrefillPersistentMaxK, where stream-K's partial tiles (128 x 128 fp32 each, as many bytes as
// 64 K of the weight tile), its turnstile fixup and the memset of its barriers cost more than
// the idle SMs. H200, gemm_bench graph replays, persistent vs stream-K µs: Flash at m = 128
// (af55cb6) wq_a (8 tiles, K 4096) 19.6 vs 22.4, wkv (4, 4096) 19.1 vs 22.5, indexer wq_b (64,
// 1024) 10.8 vs 12.0, shared w1|w3 (16, 4096) 18.0 vs 20.4, w13 fused (32, 4096) 18.3 vs 20.9,
// w2 (32, 2048) 13.2 vs 16.0; Flash at m = 256 (27ab7ca) wq_a 18.7 vs 19.8, wkv 18.0 vs 19.8,
// indexer wq_b 10.5 vs 11.5, w1|w3 17.8 vs 20.1, w13 18.3 vs 20.5, w2 12.7 vs 16.0; Pro at m =
// 128 (K 1536 and 3072) level: 11.9 vs 11.8, 15.6 vs 15.6.
constexpr int kPrefillPersistentMaxK = 4096;
constexpr int kPrefillPersistentMaxM = 2 * gemm_cfg::kPrefillTileM;
inline bool prefill_use_stream_k(int m, int n, int k, int sm_count) {
  if (m <= kPrefillPersistentMaxM && k <= kPrefillPersistentMaxK) return false;
  const long long tiles = (long long)((m + gemm_cfg::kPrefillTileM - 1) / gemm_cfg::kPrefillTileM) *
                          ((n + gemm_cfg::kPrefillTileN - 1) / gemm_cfg::kPrefillTileN);
  return tiles < sm_count && k >= 4 * gemm_cfg::kPrefillTileK;
}

// Where stream-K is taken at up to two rows of tiles (so K > kPrefillPersistentMaxK), CUTLASS's
// split-K decomposition in 2 (each tile's K halved over two CTAs, the same deterministic fixup)
// beats stream-K's even share of all K iterations. H200 gemm_bench (27ab7ca), split-K 2 vs
// stream-K µs: Flash wo_b (K 8192) m = 128 24.5 vs 26.1, m = 256 24.8 vs 26.0; Pro at m = 128
// wq_a (K 7168) 21.9 vs 26.3, wkv 22.5 vs 26.2, shared w1|w3 22.2 vs 24.9, w13 fused 24.7 vs 25.9,
// MTP e|h 25.9 vs 27.2, wo_b (K 16384) 41.4 vs 45.1 (split-K 4 within 0.2 µs of 2 at K 7168,
// behind at 16384). Pro at m = 256 is not measured (taken to follow m = 128 and Flash's m = 256).
// 0: stream-K's own decomposition.
inline int prefill_split_k(int m, int n, int k, int sm_count) {
  return m <= kPrefillPersistentMaxM && prefill_use_stream_k(m, n, k, sm_count) ? 2 : 0;
}

}  // namespace dsv4::cuda
