#include "ops/cpu/error_bound.h"

#include <bit>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "core/parallel.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/quant.h"
#include "ops/cpu/simd.h"

namespace dsv4::cpu {

double pow2_floor(double v) {
  if (v == 0 || !std::isfinite(v)) return v == 0 ? 0.0 : std::fabs(v);
  int e;
  std::frexp(v, &e);  // |v| in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 1);
}

double bf16_ulp(double v) {
  const double p = pow2_floor(v);
  return p == 0 || p < 0x1p-126 ? 0x1p-133 : p * 0x1p-7;
}

double f32_ulp(double v) {
  const double p = pow2_floor(v);
  return p == 0 || p < 0x1p-126 ? 0x1p-149 : p * 0x1p-23;
}

// ---- tensor-core sums ------------------------------------------------------------------------

namespace {

// Work items of bound_rows: kBoundRows rows x kBoundCols columns (a step's weights, up to 32 x
// 128 floats, and the rows' state stay in the core's caches).
constexpr int kBoundCols = 128;
constexpr int kBoundRows = 8;

// The largest power of two <= v for v >= 0 (0 for 0; inf and NaN kept): the exponent field
// alone, selected on integers so that the loops vectorise. No subnormal double reaches it:
// every value is a sum of products of two floats (a multiple of 2^-298) or such a power of two
// times 2^-frac_bits.
inline double pow2_floor_nonneg(double v) {
  const uint64_t b = std::bit_cast<uint64_t>(v), e = b & 0x7FF0000000000000ull;
  return std::bit_cast<double>(e == 0x7FF0000000000000ull ? b : e);
}

// The columns' running state of one row in bound_rows: the chain's exact partial (C) and its
// bound (Bc), the bound over every step of this accumulate-step width (B), the largest over
// the widths (Bmax), sum |p| (S) and sum p (P) over K.
struct BoundState {
  alignas(64) double C[kBoundCols], Bc[kBoundCols], B[kBoundCols], Bmax[kBoundCols], S[kBoundCols],
      P[kBoundCols];
};

// One accumulate step (products k0 .. k1) of one row `a` (K values) on nc <= kBoundCols columns
// of the transposed weights `wt` (row stride N). sums: also add the products to S and P (the
// first width only). Compiled for AVX-512F, AVX2 and the baseline ISA (simd.h): every step is exact
// or one IEEE operation on its own column, so both versions give the same bits.
DSV4_MULTIVERSION
void bound_step(const float* a, const float* wt, int N, int nc, int k0, int k1, bool sums,
                bool chain_start, double trunc, BoundState& st) {
  constexpr int kCols = kBoundCols;
  double *C = st.C, *Bc = st.Bc, *B = st.B, *S = st.S, *P = st.P;
  alignas(64) double Ps[kCols], Mx[kCols], Mn[kCols], U[kCols], Ub[kCols], Cin[kCols];
  if (chain_start)
    for (int n = 0; n < kCols; ++n) C[n] = Bc[n] = 0.0;  // the chain's exact partial, bound
  for (int n = 0; n < kCols; ++n) Ps[n] = Mx[n] = Mn[n] = 0.0;
  for (int k = k0; k < k1;) {
    // Four products a column at a time where four rows in a row have non-zero activations
    // (the same additions in the same order as one at a time, a quarter of the stores).
    if (k + 4 <= k1 && a[k] != 0.0 && a[k + 1] != 0.0 && a[k + 2] != 0.0 && a[k + 3] != 0.0) {
      const double a0 = a[k], a1 = a[k + 1], a2 = a[k + 2], a3 = a[k + 3];
      const float *w0 = wt + size_t(k) * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
      for (int n = 0; n < nc; ++n) {
        const double p0 = a0 * double(w0[n]), p1 = a1 * double(w1[n]), p2 = a2 * double(w2[n]),
                     p3 = a3 * double(w3[n]);
        Ps[n] = (((Ps[n] + p0) + p1) + p2) + p3;
        Mx[n] = std::max(
            std::max(std::max(std::max(Mx[n], std::fabs(p0)), std::fabs(p1)), std::fabs(p2)),
            std::fabs(p3));
      }
      if (sums)
        for (int n = 0; n < nc; ++n) {
          const double p0 = a0 * double(w0[n]), p1 = a1 * double(w1[n]), p2 = a2 * double(w2[n]),
                       p3 = a3 * double(w3[n]);
          S[n] = (((S[n] + std::fabs(p0)) + std::fabs(p1)) + std::fabs(p2)) + std::fabs(p3);
          P[n] = (((P[n] + p0) + p1) + p2) + p3;
        }
      k += 4;
      continue;
    }
    const double ak = a[k];
    if (ak != 0.0) {
      const float* wk = wt + size_t(k) * N;
      for (int n = 0; n < nc; ++n) {
        const double p = ak * double(wk[n]);
        Ps[n] += p;
        Mx[n] = std::max(Mx[n], std::fabs(p));
      }
      if (sums)
        for (int n = 0; n < nc; ++n) {
          const double p = ak * double(wk[n]);
          S[n] += std::fabs(p);
          P[n] += p;
        }
    }
    ++k;
  }
  for (int n = 0; n < nc; ++n) {
    // The GPU's incoming accumulator: the exact chain partial within the chain's bound
    // (0 at a chain's start, where both were just cleared).
    Cin[n] = std::fabs(C[n]) + Bc[n];
    U[n] = pow2_floor_nonneg(std::max(Mx[n], Cin[n])) * trunc;
    Ub[n] = U[n] * 0x1p52;
  }
  // What truncation at U drops of |p|: |p| less its floor to a multiple of U, found by
  // rounding at U's place (adding 2^52 U: |p| < 2^24 U here) and stepping down where that
  // rounded up. Every step is exact (U is a power of two) and free of branches and libm
  // calls, so the loop vectorises; U = 0 (every |p| of the step 0) adds 0.
  const auto loss = [](double ap, double u, double ub) {
    const double t = (ap + ub) - ub;
    return ap - (t - (t > ap ? u : 0.0));
  };
  for (int k = k0; k < k1;) {
    if (k + 4 <= k1 && a[k] != 0.0 && a[k + 1] != 0.0 && a[k + 2] != 0.0 && a[k + 3] != 0.0) {
      const double a0 = a[k], a1 = a[k + 1], a2 = a[k + 2], a3 = a[k + 3];
      const float *w0 = wt + size_t(k) * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
      for (int n = 0; n < nc; ++n)
        Mn[n] = (((Mn[n] + loss(std::fabs(a0 * double(w0[n])), U[n], Ub[n])) +
                  loss(std::fabs(a1 * double(w1[n])), U[n], Ub[n])) +
                 loss(std::fabs(a2 * double(w2[n])), U[n], Ub[n])) +
                loss(std::fabs(a3 * double(w3[n])), U[n], Ub[n]);
      k += 4;
      continue;
    }
    const double ak = a[k];
    if (ak != 0.0) {
      const float* wk = wt + size_t(k) * N;
      for (int n = 0; n < nc; ++n) Mn[n] += loss(std::fabs(ak * double(wk[n])), U[n], Ub[n]);
    }
    ++k;
  }
  for (int n = 0; n < nc; ++n) {
    double e = Mn[n] + std::min(Cin[n], U[n]);
    C[n] += Ps[n];
    e += pow2_floor_nonneg(std::fabs(C[n]) + Bc[n] + e) * trunc;  // the result's truncation
    Bc[n] += e;
    B[n] += e;
  }
}

// linear_error_bound of `rows` rows of `a` (row stride K) and nc <= kBoundCols columns of the
// transposed weights `wt` (row stride N): out_b [rows][kBoundCols] the bound before its final
// 2^-20 margin (f32_terms: the fp32 roundings outside the chains, per unit of sum |p|), out_p
// the exact sums. Each row's arithmetic is bound_step's sequence for that row alone; the rows
// only share the loop over steps, so a step's weights are read from memory once for all of them
// (one row at a time streamed the whole K x columns block once per width: memory-bound).
void bound_rows(const float* a, int rows, const float* wt, int N, int nc, int K, const TcSum& tc,
                double f32_terms, double* out_b, double* out_p) {
  constexpr int kCols = kBoundCols;
  const double trunc = std::ldexp(1.0, -tc.frac_bits);
  std::vector<BoundState> st(rows);
  for (BoundState& s : st)
    for (int n = 0; n < kCols; ++n) s.S[n] = s.P[n] = s.Bmax[n] = 0.0;
  // Each accumulate-step width from the instruction's K down to min_group (the hardware's
  // internal grouping is not documented): the largest bound of them.
  for (int g = tc.slice; g >= tc.min_group; g /= 2) {
    const int steps = (K + g - 1) / g;
    const int chain = tc.chain_slices > 0 ? tc.chain_slices * (tc.slice / g) : steps;
    for (BoundState& s : st)
      for (int n = 0; n < kCols; ++n) s.B[n] = 0.0;  // bound accumulated over every step
    for (int s = 0; s < steps; ++s) {
      const int k0 = s * g, k1 = std::min(K, k0 + g);
      for (int r = 0; r < rows; ++r)
        bound_step(a + size_t(r) * K, wt, N, nc, k0, k1, g == tc.slice, s % chain == 0, trunc,
                   st[r]);
    }
    for (BoundState& s : st)
      for (int n = 0; n < nc; ++n) s.Bmax[n] = std::max(s.Bmax[n], s.B[n]);
  }
  for (int r = 0; r < rows; ++r)
    for (int n = 0; n < nc; ++n) {
      const BoundState& s = st[r];
      out_b[size_t(r) * kCols + n] = s.Bmax[n] + f32_terms * s.S[n] + K * 0x1p-52 * s.S[n];
      out_p[size_t(r) * kCols + n] = s.P[n];
    }
}

}  // namespace

void linear_error_bound(const Linear& w, const float* x, int m, const TcSum& tc, float* bound,
                        double* exact) {
  const int N = w.out, K = w.in;
  const bool quant = w.kind == LinearKind::kFp8 || w.kind == LinearKind::kFp4;
  DSV4_CHECK(tc.slice > 0 && tc.frac_bits > 0 && tc.min_group > 0 && tc.min_group <= tc.slice,
             "linear_error_bound: bad sum model");
  const int slices = (K + tc.slice - 1) / tc.slice;
  const int promotions = tc.chain_slices > 0 ? (slices + tc.chain_slices - 1) / tc.chain_slices : 1;
  // fp32 roundings outside the chains: the GPU's promotions and reductions, the CPU's rounding
  // of each of its K blocks to fp32 and its fp32 accumulation of them (kF32/kBf16: one block).
  const int cpu_blocks = (K + linear_kblock(w) - 1) / linear_kblock(w);
  const double f32_terms = (promotions + tc.fp32_adds + 2.0 * cpu_blocks) * 0x1p-24;
  constexpr int kCols = kBoundCols;
  // The activations as cpu::linear quantises them, then (8-row tile, 128-column chunk) work items
  // over the host's cores: the bound costs a few GEMMs' worth of scalar work per linear.
  std::vector<float> a(size_t(m) * K);
  for (int r = 0; r < m; ++r) {
    if (quant)
      fake_quant_fp8(x + size_t(r) * K, K, 128, a.data() + size_t(r) * K);
    else
      std::copy(x + size_t(r) * K, x + size_t(r + 1) * K, a.begin() + size_t(r) * K);
  }
  const int chunks = (N + kCols - 1) / kCols;
  const int tiles = (m + kBoundRows - 1) / kBoundRows;
  const int64_t items = int64_t(tiles) * chunks;
  // Threads only where the work pays for them (a decode row of a small linear runs inline).
  parallel_for(items, int64_t(m) * chunks * kCols * int64_t(K) * 4, [&](int64_t item) {
    const int r0 = int(item / chunks) * kBoundRows, n0 = int(item % chunks) * kCols;
    const int rows = std::min(kBoundRows, m - r0), nc = std::min(kCols, N - n0);
    std::vector<double> B(size_t(rows) * kCols), P(size_t(rows) * kCols);
    bound_rows(a.data() + size_t(r0) * K, rows, w.wt.data() + n0, N, nc, K, tc, f32_terms, B.data(),
               P.data());
    for (int r = 0; r < rows; ++r)
      for (int n = 0; n < nc; ++n) {
        const size_t o = size_t(r0 + r) * N + n0 + n;
        bound[o] = static_cast<float>(B[size_t(r) * kCols + n] * (1 + 0x1p-20));
        if (exact) exact[o] = P[size_t(r) * kCols + n];
      }
  });
}

// ---- intervals -----------------------------------------------------------------------------

Iv operator*(Iv a, Iv b) {
  const double p[4] = {a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi};
  return {*std::min_element(p, p + 4), *std::max_element(p, p + 4)};
}

Iv widen_f32(Iv a, int ops) {
  const double m = std::max(std::fabs(a.lo), std::fabs(a.hi));
  return widen(a, ops * 0x1p-24 * m * (1 + 0x1p-20));
}

// Interval ends to float, rounded outward (the conversion must not narrow the interval).
static float float_down(double v) {
  float f = static_cast<float>(v);
  return double(f) > v ? std::nextafter(f, -INFINITY) : f;
}
static float float_up(double v) {
  float f = static_cast<float>(v);
  return double(f) < v ? std::nextafter(f, INFINITY) : f;
}

Iv round_ends_bf16(Iv a) {
  return {double(dsv4::round_bf16(float_down(a.lo))), double(dsv4::round_bf16(float_up(a.hi)))};
}

Iv relu_ends(Iv a) {
  return {std::max(a.lo, 0.0), std::max(a.hi, 0.0)};
}

double fake_e4m3(double x, double s) {
  return double(
             e4m3_to_float(float_to_e4m3(std::clamp(float(x) / float(s), -kE4m3Max, kE4m3Max)))) *
         s;
}

double fake_e2m1(double x, double s) {
  return double(
             e2m1_to_float(float_to_e2m1(std::clamp(float(x) / float(s), -kE2m1Max, kE2m1Max)))) *
         s;
}

void fake_quant_interval(const Iv* x, int n, int block, bool fp4, Iv* out) {
  DSV4_CHECK(block > 0 && n % block == 0, "fake_quant_interval: ", n, " not a multiple of ", block);
  const float floor_amax = fp4 ? kFp4AmaxFloor : kFp8AmaxFloor;
  const float qmax = fp4 ? kE2m1Max : kE4m3Max;
  for (int b = 0; b < n / block; ++b) {
    const Iv* xb = x + size_t(b) * block;
    float amax_lo = 0, amax_hi = 0;
    for (int i = 0; i < block; ++i) {
      const double lo = xb[i].lo, hi = xb[i].hi;
      const double min_abs = lo <= 0 && hi >= 0 ? 0.0 : std::min(std::fabs(lo), std::fabs(hi));
      amax_lo = std::max(amax_lo, float_down(min_abs));
      amax_hi = std::max(amax_hi, float_up(std::max(std::fabs(lo), std::fabs(hi))));
    }
    // The block scale is monotone in amax: every power of two between the two ends.
    const float s_lo = pow2_ceil(std::max(amax_lo, floor_amax) * (1.0f / qmax));
    const float s_hi = pow2_ceil(std::max(amax_hi, floor_amax) * (1.0f / qmax));
    for (int i = 0; i < block; ++i) {
      Iv q{INFINITY, -INFINITY};
      for (double s = s_lo; s <= double(s_hi); s *= 2) {
        const double xl = float_down(xb[i].lo), xh = float_up(xb[i].hi);
        const double lo = fp4 ? fake_e2m1(xl, s) : fake_e4m3(xl, s);
        const double hi = fp4 ? fake_e2m1(xh, s) : fake_e4m3(xh, s);
        q.lo = std::min(q.lo, lo);
        q.hi = std::max(q.hi, hi);
      }
      out[size_t(b) * block + i] = q;
    }
  }
}

// ---- ops on intervals -------------------------------------------------------------------

void attention_interval(const SparseAttnParams& p, const float* q, const float* const* keys,
                        int num_keys, Iv* out) {
  const int D = p.head_dim;
  const int blocks = (num_keys + kAttnKeyBlock - 1) / kAttnKeyBlock + 8;
  std::vector<double> s(num_keys), ds(num_keys);
  for (int h = 0; h < p.n_heads; ++h) {
    const float* qh = q + size_t(h) * D;
    double m = -INFINITY;
    for (int j = 0; j < num_keys; ++j) {
      if (!keys[j]) continue;
      double d = 0, sabs = 0;
      for (int i = 0; i < D; ++i) {
        d += double(qh[i]) * keys[j][i];
        sabs += std::fabs(double(qh[i]) * keys[j][i]);
      }
      s[j] = d * p.softmax_scale;
      ds[j] = (dot_error_bound(D, sabs) + 2 * 0x1p-24 * std::fabs(d)) * p.softmax_scale;
      m = std::max(m, s[j]);
    }
    Iv* oh = out + size_t(h) * D;
    const double sink = p.sink[h];
    // Exponent error of a key: its score's, the max's (another score), the scaled scores'
    // and the subtraction's roundings, exp itself (within 2^-21 relative) and the rescales.
    auto exp_err = [&](double sj, double dsj) {
      return dsj + (std::fabs(sj) + std::fabs(m)) * 0x1p-22 + 0x1p-21 + blocks * 0x1p-23;
    };
    double den_lo = 0, den_hi = 0;
    std::vector<double> wlo(num_keys, 0), whi(num_keys, 0);
    double dmax = 0;
    for (int j = 0; j < num_keys; ++j)
      if (keys[j]) dmax = std::max(dmax, ds[j]);
    for (int j = 0; j < num_keys; ++j) {
      if (!keys[j]) continue;
      // The running max of either side is some score within its bound of the true one.
      const double e = std::exp(s[j] - m), x = exp_err(s[j], ds[j]) + dmax;
      // Weights below 2^-100 of the largest may underflow or flush to zero on either side.
      wlo[j] = e < 0x1p-100 ? 0.0 : e * std::exp(-x) * (1 - 0x1p-9);
      whi[j] = e * std::exp(x) * (1 + 0x1p-9);
      // The denominator may sum the probabilities before or after their BF16 rounding.
      den_lo += wlo[j];
      den_hi += whi[j];
    }
    const double xs = exp_err(sink, 0) + dmax;
    den_lo += std::exp(sink - m) * std::exp(-xs);
    den_hi += std::exp(sink - m) * std::exp(xs);
    den_lo *= 1 - (num_keys + blocks) * 0x1p-23;
    den_hi *= 1 + (num_keys + blocks) * 0x1p-23;
    for (int d = 0; d < D; ++d) {
      double lo = 0, hi = 0, mag = 0;
      for (int j = 0; j < num_keys; ++j) {
        if (!keys[j]) continue;
        const double v = keys[j][d];
        lo += v >= 0 ? wlo[j] * v : whi[j] * v;
        hi += v >= 0 ? whi[j] * v : wlo[j] * v;
        mag += whi[j] * std::fabs(v);
      }
      const double err = dot_error_bound(num_keys, mag) + blocks * 2 * 0x1p-24 * mag;
      lo -= err;
      hi += err;
      Iv o;
      if (lo >= 0)
        o = {lo / den_hi, hi / den_lo};
      else if (hi <= 0)
        o = {lo / den_lo, hi / den_hi};
      else
        o = {lo / den_lo, hi / den_lo};
      oh[d] = round_ends_bf16(widen_f32(o, 2));
    }
  }
}

// ---- judging -------------------------------------------------------------------------------

double element_tolerance(float got, float want, double bound, Rounding r) {
  switch (r) {
    case Rounding::kNone:
      return bound;
    case Rounding::kBf16:
      return bound + 0.5 * (bf16_ulp(got) + bf16_ulp(want));
    case Rounding::kF32:
      return bound + 0.5 * (f32_ulp(got) + f32_ulp(want));
  }
  return bound;
}

BoundCheck check_bounds(const float* got, const float* want, const float* bound, size_t n,
                        Rounding r) {
  BoundCheck c;
  c.n = n;
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = got[i], y = want[i];
    if (std::isnan(x) != std::isnan(y)) {
      c.nan_mismatch = true;
      if (c.first_bad == SIZE_MAX) c.first_bad = i;
      continue;
    }
    if (std::isnan(x) || (std::isinf(x) && std::isinf(y) && (x > 0) == (y > 0))) continue;
    const double d = std::fabs(x - y);
    num += d * d;
    den += y * y;
    const double tol = element_tolerance(got[i], want[i], bound[i], r);
    const double ratio = d == 0 ? 0.0 : tol > 0 ? d / tol : INFINITY;
    if (ratio > c.worst_ratio) {
      c.worst_ratio = ratio;
      c.worst = i;
      c.worst_tol = tol;
    }
    if (!(d <= tol)) {
      ++c.beyond;
      if (c.first_bad == SIZE_MAX) c.first_bad = i;
    }
  }
  c.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return c;
}

}  // namespace dsv4::cpu
