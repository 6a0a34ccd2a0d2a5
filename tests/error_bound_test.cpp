// The error bounds verify mode judges ops by (ops/cpu/error_bound.h): an emulation of the FP8
// tensor-core sum the bound models (per-operand alignment truncation to 13 fraction bits inside
// chained k32 steps, fp32 promotion per 128 block) always lands inside the bound, on random and on
// cancellation-heavy inputs where it lands several BF16 ulps from the exact sum; results moved
// just inside / just outside the bound are accepted / rejected; a corrupted weight is caught.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/formats.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/error_bound.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/quant.h"

namespace dsv4::cpu {
namespace {

// FP8 weights: e4m3 codes times a power-of-two scale per 128x128 block, as the checkpoints hold.
Linear random_fp8_linear(int out, int in, uint32_t seed, double spread = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> w(size_t(out) * in);
  for (int o = 0; o < out; ++o)
    for (int k = 0; k < in; ++k) {
      const float s = std::ldexp(1.0f, -8 - int((o / 128 + k / 128) % 3));
      const float v = float(nd(rng) * spread);
      w[size_t(o) * in + k] = e4m3_to_float(float_to_e4m3(std::clamp(v, -448.0f, 448.0f))) * s;
    }
  return Linear::from_rows(LinearKind::kFp8, out, in, w);
}

std::vector<float> random_bf16(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = round_bf16(nd(rng));
  return v;
}

double trunc_to(double v, double unit) {
  return unit > 0 ? std::trunc(v / unit) * unit : v;
}

// The hardware model of the bound: a step aligns its products and the incoming accumulator to
// the largest operand, drops what lies below 2^-13 of its leading bit (toward zero), sums, and
// keeps 13 fraction bits of the result; steps of `group` products, `chain` k32 instructions per
// fp32 promotion.
std::vector<float> emulate_fp8_tc(const Linear& w, const std::vector<float>& x, int m, int chain,
                                  int group = 32) {
  const int N = w.out, K = w.in;
  std::vector<float> y(size_t(m) * N), a(K);
  for (int r = 0; r < m; ++r) {
    fake_quant_fp8(x.data() + size_t(r) * K, K, 128, a.data());
    for (int n = 0; n < N; ++n) {
      float acc = 0.0f;
      double c = 0;
      const int steps_per_chain = chain * (32 / group);
      for (int s = 0; s < K / group; ++s) {
        if (s % steps_per_chain == 0) c = 0;
        double mx = std::fabs(c);
        for (int k = s * group; k < (s + 1) * group; ++k)
          mx = std::max(mx, std::fabs(double(a[k]) * w.wt[size_t(k) * N + n]));
        const double u = pow2_floor(mx) * 0x1p-13;
        double sum = trunc_to(c, u);
        for (int k = s * group; k < (s + 1) * group; ++k)
          sum += trunc_to(double(a[k]) * w.wt[size_t(k) * N + n], u);
        c = trunc_to(sum, pow2_floor(sum) * 0x1p-13);
        if ((s + 1) % steps_per_chain == 0) acc += float(c);
      }
      y[size_t(r) * N + n] = round_bf16(acc);
    }
  }
  return y;
}

struct Case {
  int out, in, m;
  double spread;
};

TEST(ErrorBound, EmulatedFp8TensorCoreSumsStayInsideTheBound) {
  for (const Case& cs :
       {Case{256, 384, 16, 1.0}, Case{384, 512, 8, 1.0}, Case{128, 1024, 4, 8.0}}) {
    const Linear w = random_fp8_linear(cs.out, cs.in, 7 + cs.in, cs.spread);
    const std::vector<float> x = random_bf16(size_t(cs.m) * cs.in, 3 + cs.out);
    std::vector<float> want(size_t(cs.m) * cs.out), bound(want.size());
    linear(w, x.data(), cs.m, want.data());
    for (const auto& [tc, chain] : {std::pair{kFp8WgmmaBlock, 4}, std::pair{kFp8WgmmaSlice, 1}})
      for (int group : {32, 16, 8}) {
        linear_error_bound(w, x.data(), cs.m, tc, bound.data());
        const std::vector<float> got = emulate_fp8_tc(w, x, cs.m, chain, group);
        const BoundCheck c =
            check_bounds(got.data(), want.data(), bound.data(), got.size(), Rounding::kBf16);
        EXPECT_TRUE(c.ok()) << cs.out << "x" << cs.in << " chain " << chain << " group " << group
                            << ": " << c.beyond << " beyond, worst ratio " << c.worst_ratio;
        std::printf("  %dx%d chain %d group %d: worst |d| / tolerance %.3f\n", cs.out, cs.in, chain,
                    group, c.worst_ratio);
        // Not trivially wide: the worst element uses a visible part of its tolerance.
        EXPECT_GT(c.worst_ratio, 0.1);
      }
  }
}

// The bound of a row does not depend on the rows computed with it: linear_error_bound works on
// tiles of several rows (sharing each step's weights in the cache), so 11 rows (a tile and a
// partial one) at 300 columns (two full column chunks and a partial one), with zero runs in the
// activations (the 4-wide and single-product paths), give the bits of each row computed alone.
TEST(ErrorBound, RowsComputedTogetherMatchEachRowAlone) {
  const int out = 300, in = 512, m = 11;
  const Linear w = random_fp8_linear(out, in, 41);
  std::vector<float> x = random_bf16(size_t(m) * in, 43);
  for (int r = 0; r < m; ++r)
    for (int k = 0; k < in; ++k)
      if ((k * 7 + r * 3) % 13 < 2 + r % 3) x[size_t(r) * in + k] = 0.0f;
  for (const TcSum& tc : {kFp8WgmmaBlock, kFp8WgmmaSlice, kBf16Mma}) {
    std::vector<float> all(size_t(m) * out), one(out);
    std::vector<double> all_p(all.size()), one_p(out);
    linear_error_bound(w, x.data(), m, tc, all.data(), all_p.data());
    for (int r = 0; r < m; ++r) {
      linear_error_bound(w, x.data() + size_t(r) * in, 1, tc, one.data(), one_p.data());
      for (int n = 0; n < out; ++n) {
        ASSERT_EQ(all[size_t(r) * out + n], one[n]) << "row " << r << " column " << n;
        ASSERT_EQ(all_p[size_t(r) * out + n], one_p[n]) << "row " << r << " column " << n;
      }
    }
    EXPECT_GT(all[0], 0.0f);
  }
}

// Rows built so every output nearly cancels: y = x.w with x = a row minus its projection, so the
// exact sums are tiny next to sum|p| and the 13-bit steps leave errors of many BF16 ulps of y.
TEST(ErrorBound, CancellationHeavyOutputsAreAcceptedWithinTheBound) {
  const int N = 128, K = 384, m = 64;
  const Linear w = random_fp8_linear(N, K, 11);
  std::vector<float> x = random_bf16(size_t(m) * K, 12, 4.0f);
  // Make column 0's output cancel: x_k += t * w_k0 for a t that zeroes sum x_k w_k0.
  for (int r = 0; r < m; ++r) {
    float* xr = x.data() + size_t(r) * K;
    double xw = 0, ww = 0;
    for (int k = 0; k < K; ++k) {
      xw += double(xr[k]) * w.wt[size_t(k) * N];
      ww += double(w.wt[size_t(k) * N]) * w.wt[size_t(k) * N];
    }
    for (int k = 0; k < K; ++k) xr[k] = round_bf16(float(xr[k] - xw / ww * w.wt[size_t(k) * N]));
  }
  std::vector<float> want(size_t(m) * N), bound(want.size());
  linear(w, x.data(), m, want.data());
  linear_error_bound(w, x.data(), m, kFp8WgmmaBlock, bound.data());
  const std::vector<float> got = emulate_fp8_tc(w, x, m, 4);
  int beyond_one_ulp = 0;
  for (int r = 0; r < m; ++r) {
    const size_t i = size_t(r) * N;
    const double d = std::fabs(double(got[i]) - want[i]);
    beyond_one_ulp += d > bf16_ulp(std::max(std::fabs(got[i]), std::fabs(want[i])));
  }
  // The old rule's failure mode: outputs more than one BF16 ulp off ...
  EXPECT_GT(beyond_one_ulp, 0);
  // ... which the derived bound accepts.
  const BoundCheck c =
      check_bounds(got.data(), want.data(), bound.data(), got.size(), Rounding::kBf16);
  EXPECT_TRUE(c.ok()) << c.beyond << " beyond, worst ratio " << c.worst_ratio;
}

TEST(ErrorBound, JustInsideAcceptedJustOutsideRejected) {
  const int N = 256, K = 512, m = 4;
  const Linear w = random_fp8_linear(N, K, 21);
  const std::vector<float> x = random_bf16(size_t(m) * K, 22);
  std::vector<float> want(size_t(m) * N), bound(want.size());
  linear(w, x.data(), m, want.data());
  linear_error_bound(w, x.data(), m, kFp8WgmmaBlock, bound.data());
  for (size_t i : {size_t(0), size_t(N + 5), want.size() - 1}) {
    const double sign = want[i] < 0 ? -1.0 : 1.0;
    const double tol = element_tolerance(want[i], want[i], bound[i], Rounding::kBf16);
    ASSERT_GT(tol, 0);
    // Away from zero the tolerance only grows (ulp of the larger value): 0.99 of it is inside.
    std::vector<float> got = want;
    got[i] = float(want[i] + sign * 0.99 * tol);
    EXPECT_TRUE(
        check_bounds(got.data(), want.data(), bound.data(), got.size(), Rounding::kBf16).ok())
        << i;
    // Toward zero it only shrinks: 1.01 of it is outside, and the check names the element.
    got[i] = float(want[i] - sign * 1.01 * tol);
    const BoundCheck c =
        check_bounds(got.data(), want.data(), bound.data(), got.size(), Rounding::kBf16);
    EXPECT_FALSE(c.ok()) << i;
    EXPECT_EQ(c.first_bad, i);
    EXPECT_EQ(c.beyond, 1u);
    EXPECT_GT(c.worst_ratio, 1.0);
  }
  // Without output roundings the bound is the tolerance itself.
  std::vector<float> got = want;
  got[3] = float(want[3] + 1.01 * bound[3]);
  EXPECT_FALSE(
      check_bounds(got.data(), want.data(), bound.data(), got.size(), Rounding::kNone).ok());
  got[3] = float(want[3] + 0.99 * bound[3]);
  EXPECT_TRUE(
      check_bounds(got.data(), want.data(), bound.data(), got.size(), Rounding::kNone).ok());
}

TEST(ErrorBound, CatchesACorruptedWeight) {
  const int N = 256, K = 512, m = 8;
  const Linear w = random_fp8_linear(N, K, 31);
  Linear bad = w;
  // One weight set to the block's largest code (as verify's planted fault writes 0x7e codes).
  const int k = 200, n = 17;
  bad.wt[size_t(k) * N + n] = 448.0f * std::ldexp(1.0f, -8 - int((n / 128 + k / 128) % 3));
  const std::vector<float> x = random_bf16(size_t(m) * K, 32);
  std::vector<float> want(size_t(m) * N), bound(want.size());
  linear(w, x.data(), m, want.data());
  linear_error_bound(w, x.data(), m, kFp8WgmmaBlock, bound.data());
  const std::vector<float> got = emulate_fp8_tc(bad, x, m, 4);
  const BoundCheck c =
      check_bounds(got.data(), want.data(), bound.data(), got.size(), Rounding::kBf16);
  EXPECT_FALSE(c.ok());
  EXPECT_EQ(c.first_bad % N, size_t(n));
}

TEST(ErrorBound, Bf16ChainBoundIsTight) {
  // BF16 products with fp32 accumulation: the bound is a few fp32 ulps of sum|p|, far below a
  // BF16 ulp of the output for outputs that do not cancel.
  const int N = 64, K = 1024, m = 2;
  std::vector<float> wv = random_bf16(size_t(N) * K, 41, 0.05f);
  const Linear w = Linear::from_rows(LinearKind::kBf16, N, K, wv);
  const std::vector<float> x = random_bf16(size_t(m) * K, 42);
  std::vector<float> bound(size_t(m) * N), y(bound.size());
  linear_error_bound(w, x.data(), m, kBf16Mma, bound.data());
  linear(w, x.data(), m, y.data());
  for (size_t i = 0; i < y.size(); ++i) {
    double s = 0;
    for (int k = 0; k < K; ++k)
      s += std::fabs(double(x[(i / N) * K + k]) * w.wt[size_t(k) * N + i % N]);
    EXPECT_LT(bound[i], 0x1p-14 * s) << i;
    EXPECT_GT(bound[i], 0x1p-24 * s) << i;
  }
}

// Sparse attention: the CPU op and a GPU-like evaluation (keys split in two halves, each with its
// own running max for the BF16 probabilities, fp32 sums, combined at the end) both land inside
// attention_interval; an output moved by a few percent of the values' scale does not.
TEST(ErrorBound, AttentionIntervalCoversSplitEvaluations) {
  const int H = 2, D = 128, N = 190;
  std::mt19937 rng(61);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(size_t(H) * D), kv(size_t(N) * D), sink{0.5f, -1.0f};
  for (float& v : q) v = round_bf16(nd(rng) * 0.3f);
  for (float& v : kv) v = round_bf16(nd(rng));
  std::vector<const float*> keys(N);
  for (int j = 0; j < N; ++j) keys[j] = j % 17 == 5 ? nullptr : kv.data() + size_t(j) * D;
  SparseAttnParams p;
  p.n_heads = H;
  p.head_dim = D;
  p.softmax_scale = 0.25f;
  p.sink = sink.data();
  std::vector<float> want(size_t(H) * D), split(want.size()), bound(want.size());
  sparse_attention(p, q.data(), keys.data(), N, want.data());
  std::vector<Iv> iv(want.size());
  attention_interval(p, q.data(), keys.data(), N, iv.data());
  for (int h = 0; h < H; ++h) {
    const float* qh = q.data() + size_t(h) * D;
    std::vector<float> s(N, -INFINITY);
    for (int j = 0; j < N; ++j) {
      if (!keys[j]) continue;
      float d = 0;
      for (int i = 0; i < D; ++i) d += qh[i] * keys[j][i];
      s[j] = d * p.softmax_scale;
    }
    float num[2][D] = {}, den[2] = {}, mx[2] = {-INFINITY, -INFINITY};
    for (int j = 0; j < N; ++j) mx[j * 2 / N] = std::max(mx[j * 2 / N], s[j]);
    for (int j = 0; j < N; ++j) {
      if (!keys[j]) continue;
      const int sp = j * 2 / N;
      const float e = std::exp(s[j] - mx[sp]);
      den[sp] += e;
      for (int i = 0; i < D; ++i) num[sp][i] += round_bf16(e) * keys[j][i];
    }
    const float m = std::max(mx[0], mx[1]);
    const float a0 = std::exp(mx[0] - m), a1 = std::exp(mx[1] - m);
    const float dd = den[0] * a0 + den[1] * a1 + std::exp(sink[h] - m);
    for (int i = 0; i < D; ++i)
      split[size_t(h) * D + i] = round_bf16((num[0][i] * a0 + num[1][i] * a1) / dd);
  }
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(iv[i].contains(want[i])) << i << ": " << want[i];
    EXPECT_TRUE(iv[i].contains(split[i])) << i << ": " << split[i] << " vs " << want[i];
    bound[i] = static_cast<float>(std::max(iv[i].hi - want[i], want[i] - iv[i].lo));
  }
  const BoundCheck ok =
      check_bounds(split.data(), want.data(), bound.data(), want.size(), Rounding::kNone);
  EXPECT_TRUE(ok.ok());
  double mean = 0, rms = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    mean += bound[i] / want.size();
    rms += double(want[i]) * want[i] / want.size();
  }
  std::printf("  attention: mean bound %.3g (output rms %.3g), split evaluation at %.3f of it\n",
              mean, std::sqrt(rms), ok.worst_ratio);
  // Not vacuous: moving one output by 5 % of the values' scale (1) is caught.
  std::vector<float> moved = want;
  moved[7] += 0.05f;
  const BoundCheck c =
      check_bounds(moved.data(), want.data(), bound.data(), want.size(), Rounding::kNone);
  EXPECT_FALSE(c.ok());
  EXPECT_EQ(c.first_bad, 7u);
}

TEST(ErrorBound, FakeQuantIntervalCoversBothSidesOfARoundingBoundary) {
  // A point interval is the fake quantisation itself.
  std::vector<float> x = random_bf16(128, 51);
  std::vector<float> fq(128);
  fake_quant_fp8(x.data(), 128, 128, fq.data());
  std::vector<Iv> iv(128), q(128);
  for (int i = 0; i < 128; ++i) iv[i] = Iv::of(x[i]);
  fake_quant_interval(iv.data(), 128, 128, false, q.data());
  for (int i = 0; i < 128; ++i) {
    EXPECT_EQ(q[i].lo, fq[i]) << i;
    EXPECT_EQ(q[i].hi, fq[i]) << i;
  }
  // An interval around a midpoint between two e4m3 values (scale 1: block amax 448) spans both.
  std::vector<Iv> b(128, Iv::of(1.0));
  b[0] = Iv::of(448.0);
  b[1] = Iv::of(1.0625, 1e-6);  // midpoint of 1.0 and 1.125
  fake_quant_interval(b.data(), 128, 128, false, q.data());
  EXPECT_EQ(q[1].lo, 1.0);
  EXPECT_EQ(q[1].hi, 1.125);
  // An amax interval that crosses a power of two takes both block scales: 3 * 2^-11 is 0.75 of
  // the subnormal step 2^-9 at scale 1 (-> 2^-9) and 0.375 of it at scale 2 (-> 0).
  b[0] = Iv{447.0, 449.0};
  b[2] = Iv::of(3 * 0x1p-11);
  fake_quant_interval(b.data(), 128, 128, false, q.data());
  EXPECT_EQ(q[2].lo, 0.0);
  EXPECT_EQ(q[2].hi, 0x1p-9);
}

TEST(ErrorBound, IntervalRoundingIsMonotone) {
  // Ends closer to the midpoint 1 + 2^-8 than a float can tell still round outward.
  const Iv a = round_ends_bf16(Iv{1.0 + 0x1p-8 - 1e-12, 1.0 + 0x1p-8 + 1e-12});
  EXPECT_EQ(a.lo, 1.0);
  EXPECT_EQ(a.hi, 1.0 + 0x1p-7);
  EXPECT_EQ(bf16_ulp(1.0), 0x1p-7);
  EXPECT_EQ(bf16_ulp(-3.0), 0x1p-6);
  EXPECT_EQ(f32_ulp(1.5), 0x1p-23);
}

}  // namespace
}  // namespace dsv4::cpu
