#include "ops/cpu/linear.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "core/parallel.h"
#include "ops/cpu/quant.h"
#include "ops/cpu/simd.h"

namespace dsv4::cpu {

Linear Linear::from_rows(LinearKind kind, int out, int in, const std::vector<float>& w) {
  DSV4_CHECK(static_cast<int64_t>(w.size()) == int64_t(out) * in, "Linear: ", w.size(),
             " values for [", out, ", ", in, "]");
  Linear l;
  l.kind = kind;
  l.out = out;
  l.in = in;
  l.wt.resize(w.size());
  // Transposed in 32 x 32 tiles (a row-by-row transpose misses the cache on every store: ~1 s
  // for a V4-Pro expert projection).
  constexpr int kTile = 32;
  for (int o0 = 0; o0 < out; o0 += kTile)
    for (int k0 = 0; k0 < in; k0 += kTile) {
      const int o1 = std::min(out, o0 + kTile), k1 = std::min(in, k0 + kTile);
      for (int o = o0; o < o1; ++o)
        for (int k = k0; k < k1; ++k) l.wt[size_t(k) * out + o] = w[size_t(o) * in + k];
    }
  return l;
}

int linear_kblock(const Linear& w) {
  switch (w.kind) {
    case LinearKind::kFp8:
      return 128;
    case LinearKind::kFp4:
      return 32;
    default:
      return w.in;
  }
}

void linear(const Linear& w, const float* x, int m, float* y) {
  const int N = w.out, K = w.in;
  const bool quant = w.kind == LinearKind::kFp8 || w.kind == LinearKind::kFp4;
  const int kb = linear_kblock(w);
  DSV4_CHECK(!quant || K % 128 == 0, "linear: K = ", K, " is not a multiple of 128");
  // Work items of (8-row tile, 256-column chunk), over the host's cores: each weight row is read
  // once per tile, a chunk's accumulators stay in L1 across the K loop, and every output keeps
  // its own accumulators and K order, so a result does not depend on the tiling or the threads.
  constexpr int kTile = 8, kColChunk = 256;
  const int tiles = (m + kTile - 1) / kTile, chunks = (N + kColChunk - 1) / kColChunk;
  parallel_for(int64_t(tiles) * chunks, int64_t(m) * N * K, [&](int64_t item) {
    const int r0 = int(item / chunks) * kTile, n0 = int(item % chunks) * kColChunk;
    const int rows = std::min(kTile, m - r0), nc = std::min(kColChunk, N - n0);
    std::vector<float> a(size_t(rows) * K), acc(size_t(rows) * kColChunk, 0.0f);
    std::vector<double> part(size_t(rows) * kColChunk);
    for (int r = 0; r < rows; ++r) {
      const float* xr = x + size_t(r0 + r) * K;
      if (quant)
        fake_quant_fp8(xr, K, 128, a.data() + size_t(r) * K);  // a_q * s_a, exact
      else
        std::copy(xr, xr + K, a.begin() + size_t(r) * K);
    }
    for (int k0 = 0; k0 < K; k0 += kb) {
      // Products of two floats are exact in double; a block's sum is rounded once to fp32,
      // which the power-of-two scales commute with.
      std::fill(part.begin(), part.end(), 0.0);
      for (int k = k0; k < k0 + kb; ++k) {
        const float* wk = w.wt.data() + size_t(k) * N + n0;
        for (int r = 0; r < rows; ++r) {
          const double ak = a[size_t(r) * K + k];
          if (ak != 0.0) axpy_f64(part.data() + size_t(r) * kColChunk, ak, wk, nc);
        }
      }
      for (int r = 0; r < rows; ++r)
        for (int n = 0; n < nc; ++n)
          acc[size_t(r) * kColChunk + n] += static_cast<float>(part[size_t(r) * kColChunk + n]);
    }
    for (int r = 0; r < rows; ++r) {
      float* yr = y + size_t(r0 + r) * N + n0;
      const float* ar = acc.data() + size_t(r) * kColChunk;
      if (w.kind == LinearKind::kF32)
        std::copy(ar, ar + nc, yr);
      else
        for (int n = 0; n < nc; ++n) yr[n] = round_bf16(ar[n]);
    }
  });
}

}  // namespace dsv4::cpu
