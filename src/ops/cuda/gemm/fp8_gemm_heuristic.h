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

// Work split of the streaming kernel: `tiles` CTAs along N (128 weight rows each) times
// `splits` CTAs along K (one cluster per tile, reduced through distributed shared memory).
struct StreamPlan {
  int tokens = 0;   // wgmma N: m padded to 8/16/32/64
  int tiles = 0;    // ceil(n / 128)
  int splits = 1;   // cluster size along K, 1..8, <= k_steps
  int k_steps = 0;  // 128-byte K steps per weight row
};

// Cost model in units of one pipeline step of one CTA (16 KB of weights): every CTA pays a
// start-up of about two steps (launch, first TMA round trip) plus its steps; CTAs beyond the
// resident slots (2 per SM) run in further waves; a split adds about one step of cluster
// synchronisation and distributed-shared-memory reduction.
inline StreamPlan plan_stream(int m, int n, int k_steps, int sm_count) {
  StreamPlan p;
  p.tokens = gemm_cfg::stream_tokens(m);
  p.tiles = (n + gemm_cfg::kStreamRows - 1) / gemm_cfg::kStreamRows;
  p.k_steps = k_steps;
  const int slots = std::max(1, sm_count) * gemm_cfg::kStreamCtasPerSm;
  double best = 1e30;
  for (int s = 1; s <= std::min(gemm_cfg::kStreamMaxSplits, k_steps); ++s) {
    const int ctas = p.tiles * s;
    const int waves = (ctas + slots - 1) / slots;
    const int per = (k_steps + s - 1) / s;
    const double cost = double(waves) * (per + 2.0) + (s > 1 ? 1.0 : 0.0);
    if (cost < best - 1e-9) {
      best = cost;
      p.splits = s;
    }
  }
  return p;
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
