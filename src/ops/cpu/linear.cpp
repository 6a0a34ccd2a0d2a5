#include "ops/cpu/linear.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "ops/cpu/quant.h"

namespace dsv4::cpu {

Linear Linear::from_rows(LinearKind kind, int out, int in, const std::vector<float>& w) {
  DSV4_CHECK(static_cast<int64_t>(w.size()) == int64_t(out) * in, "Linear: ", w.size(),
             " values for [", out, ", ", in, "]");
  Linear l;
  l.kind = kind;
  l.out = out;
  l.in = in;
  l.wt.resize(w.size());
  for (int o = 0; o < out; ++o)
    for (int k = 0; k < in; ++k) l.wt[size_t(k) * out + o] = w[size_t(o) * in + k];
  return l;
}

int linear_kblock(const Linear& w) {
  switch (w.kind) {
    case LinearKind::kFp8: return 128;
    case LinearKind::kFp4: return 32;
    default: return w.in;
  }
}

void linear(const Linear& w, const float* x, int m, float* y) {
  const int N = w.out, K = w.in;
  const bool quant = w.kind == LinearKind::kFp8 || w.kind == LinearKind::kFp4;
  const int kb = linear_kblock(w);
  DSV4_CHECK(!quant || K % 128 == 0, "linear: K = ", K, " is not a multiple of 128");
  std::vector<float> a(K);
  std::vector<double> part(N);
  std::vector<float> acc(N);
  for (int r = 0; r < m; ++r) {
    const float* xr = x + size_t(r) * K;
    if (quant) fake_quant_fp8(xr, K, 128, a.data());  // a_q * s_a, exact
    else std::copy(xr, xr + K, a.begin());
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k0 = 0; k0 < K; k0 += kb) {
      // Products of two floats are exact in double; the block sum is rounded once to fp32,
      // which the power-of-two scales commute with.
      std::fill(part.begin(), part.end(), 0.0);
      for (int k = k0; k < k0 + kb; ++k) {
        const double ak = a[k];
        if (ak == 0.0) continue;
        const float* wk = w.wt.data() + size_t(k) * N;
        for (int n = 0; n < N; ++n) part[n] += ak * static_cast<double>(wk[n]);
      }
      for (int n = 0; n < N; ++n) acc[n] += static_cast<float>(part[n]);
    }
    float* yr = y + size_t(r) * N;
    if (w.kind == LinearKind::kF32) std::copy(acc.begin(), acc.end(), yr);
    else for (int n = 0; n < N; ++n) yr[n] = round_bf16(acc[n]);
  }
}

}  // namespace dsv4::cpu
