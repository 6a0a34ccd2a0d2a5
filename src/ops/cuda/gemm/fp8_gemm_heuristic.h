// Which GEMM kernel and which work split for a shape (host-side, no device calls): kept apart
// from the kernels so the choices can be read, tested and tuned in one place.
#pragma once

#include <algorithm>

#include "ops/cuda/gemm/fp8_gemm.h"
#include "ops/cuda/gemm/fp8_gemm_config.h"

namespace dsv4::cuda {

// Decode-sized problems stream the weights; larger ones go to the tensor-core GEMM.
inline Fp8GemmPath fp8_gemm_pick_path(int m, int /*n*/, int /*k*/) {
  return m <= gemm_cfg::kStreamMaxTokens ? Fp8GemmPath::kStream : Fp8GemmPath::kTensorCore;
}

// Work split of the streaming kernel: `tiles` CTAs along N (128 weight rows each; a grouped
// launch counts the tiles of every weight) times `splits` CTAs along K (one cluster per tile,
// reduced through distributed shared memory in rank order: deterministic for a given split).
struct StreamPlan {
  int tokens = 0;   // wgmma N: m padded to 8/16/32/64
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

// Cost model in units of one pipeline step of one CTA (16 KB of weights): every CTA pays a
// start-up of about two steps (launch, first TMA round trip) plus its steps; CTAs beyond the
// resident ones run in further waves; a split adds about one step of cluster synchronisation
// and distributed-shared-memory reduction, growing with the ranks read. At decode sizes the
// weights of an N <= 2048 GEMM (Flash wq_a 1024 x 4096: 8 tiles of 32 steps) are too few
// bytes for HBM bandwidth to bind: the per-CTA step chain does, so the model takes the largest
// split that stays in one wave, which puts 8 x 16 = 128 CTAs on the 132 SMs for wq_a alone and
// 192 for wq_a + wkv grouped, where 8 splits gave 64 and 32.
inline StreamPlan plan_stream_tiles(int m, int tiles, int k_steps, const StreamResidency& res) {
  StreamPlan p;
  p.tokens = gemm_cfg::stream_tokens(m);
  p.tiles = tiles;
  p.k_steps = k_steps;
  double best = 1e30;
  const int top = std::min({gemm_cfg::kStreamMaxSplits, res.max_splits, k_steps});
  for (int s = 1; s <= top; ++s) {
    const int slots = res.resident[s];
    if (slots < s) continue;  // the device places no cluster of this size
    const int ctas = p.tiles * s;
    const int waves = (ctas + slots - 1) / slots;
    const int per = (k_steps + s - 1) / s;
    const double cost = double(waves) * (per + 2.0) + (s > 1 ? 1.0 + s / 16.0 : 0.0);
    if (cost < best - 1e-9) {
      best = cost;
      p.splits = s;
    }
  }
  return p;
}

inline StreamPlan plan_stream(int m, int n, int k_steps, int sm_count) {
  return plan_stream_tiles(m, (n + gemm_cfg::kStreamRows - 1) / gemm_cfg::kStreamRows, k_steps,
                           default_residency(sm_count));
}

// The tensor-core kernel's persistent scheduler runs whole 128x128 output tiles; when there are
// fewer tiles than SMs (decode batches of 65..~512 rows, small N) stream-K splits K so that
// every SM works.
inline bool prefill_use_stream_k(int m, int n, int k, int sm_count) {
  const long long tiles = (long long)((m + gemm_cfg::kPrefillTileM - 1) / gemm_cfg::kPrefillTileM) *
                          ((n + gemm_cfg::kPrefillTileN - 1) / gemm_cfg::kPrefillTileN);
  return tiles < sm_count && k >= 4 * gemm_cfg::kPrefillTileK;
}

}  // namespace dsv4::cuda
