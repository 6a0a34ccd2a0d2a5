// CPU reference ops against independent formulations (double-precision math written out
// directly from the spec), on fresh random inputs, edge sizes and invalid slots.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/cache_codec.h"
#include "ops/cpu/compressor.h"
#include "ops/cpu/hadamard.h"
#include "ops/cpu/indexer.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/mhc.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/quant.h"
#include "ops/cpu/rope.h"
#include "support/random_values.h"

namespace dsv4::cpu {
namespace {

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f, bool bf16 = true) {
  std::mt19937 rng(seed);
  return test::gaussian(n, scale, rng, bf16);
}

double rel_l2(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num / den);
}

TEST(Rope, YarnTableKeepsLowAndScalesHighFrequencies) {
  // Base 160000, factor 16 over 65536: dims below `low` unchanged, above `high` divided by 16.
  const RopeTable plain = RopeTable::make(64, 160000, 0, 16, 32, 1);
  const RopeTable yarn = RopeTable::make(64, 160000, 65536, 16, 32, 1);
  for (int i = 0; i <= 15; ++i) EXPECT_EQ(yarn.inv_freq[i], plain.inv_freq[i]) << i;
  for (int i = 25; i < 32; ++i) EXPECT_FLOAT_EQ(yarn.inv_freq[i], plain.inv_freq[i] / 16) << i;
  for (int i = 16; i < 25; ++i) {
    EXPECT_LT(yarn.inv_freq[i], plain.inv_freq[i]);
    EXPECT_GT(yarn.inv_freq[i], plain.inv_freq[i] / 16);
  }
  EXPECT_FLOAT_EQ(plain.inv_freq[0], 1.0f);
  EXPECT_NEAR(plain.inv_freq[1], std::pow(160000.0, -2.0 / 64), 1e-7);
}

TEST(Rope, InterleavedPairsAndInverse) {
  const RopeTable t = RopeTable::make(64, 10000, 0, 1, 32, 1);
  for (int64_t pos : {0, 1, 7, 128, 4095, 1000000}) {
    std::vector<float> c(32), s(32);
    t.cos_sin(pos, c.data(), s.data());
    std::vector<float> x = randn(64, uint32_t(pos) + 1), y = x;
    rope_apply(y.data(), 64, c.data(), s.data(), false);
    for (int i = 0; i < 32; ++i) {  // pair (2i, 2i+1) rotates by pos * f_i
      const double ang = double(float(pos) * t.inv_freq[i]);
      const double a = x[2 * i], b = x[2 * i + 1];
      EXPECT_NEAR(y[2 * i], a * std::cos(ang) - b * std::sin(ang),
                  1e-2 * (std::fabs(a) + std::fabs(b)) + 1e-6);
      EXPECT_NEAR(y[2 * i + 1], a * std::sin(ang) + b * std::cos(ang),
                  1e-2 * (std::fabs(a) + std::fabs(b)) + 1e-6);
    }
    rope_apply(y.data(), 64, c.data(), s.data(), true);
    for (int i = 0; i < 64; ++i) EXPECT_NEAR(y[i], x[i], 2e-2 * std::fabs(x[i]) + 2e-2) << pos;
  }
}

TEST(Hadamard, MatchesSylvesterMatrixAndIsInvolutive) {
  for (int n : {1, 2, 32, 128}) {
    std::vector<float> x = randn(n, 11), y = x;
    hadamard_rotate(y.data(), n);
    for (int i = 0; i < n; ++i) {
      double acc = 0;
      for (int j = 0; j < n; ++j) acc += (__builtin_popcount(i & j) % 2 ? -1.0 : 1.0) * x[j];
      acc /= std::sqrt(double(n));
      EXPECT_NEAR(y[i], acc, std::fabs(acc) / 128 + 1e-6) << n << " " << i;
    }
    hadamard_rotate(y.data(), n);  // H/sqrt(n) is its own inverse
    for (int i = 0; i < n; ++i) EXPECT_NEAR(y[i], x[i], std::fabs(x[i]) / 64 + 1e-2);
  }
  std::vector<float> bad(96);
  EXPECT_THROW(hadamard_rotate(bad.data(), 96), Error);
}

TEST(Mhc, SinkhornIsDoublyStochastic) {
  std::mt19937 rng(12);
  std::normal_distribution<float> d(0.f, 2.f);
  // 20 iterations (the model's): columns exact (normalised last), rows close; with more
  // iterations the rows converge too.
  for (auto [iters, row_tol] : {std::pair{20, 3e-2f}, std::pair{500, 1e-4f}}) {
    float worst = 0;
    for (int trial = 0; trial < 100; ++trial) {
      float c[16];
      for (float& v : c) v = d(rng);
      sinkhorn(c, 4, iters, 1e-6f);
      for (int j = 0; j < 4; ++j) {
        float row = 0, col = 0;
        for (int k = 0; k < 4; ++k) row += c[j * 4 + k], col += c[k * 4 + j];
        EXPECT_NEAR(col, 1.0f, 1e-5f);
        worst = std::max(worst, std::fabs(row - 1.0f));
        for (int k = 0; k < 4; ++k) EXPECT_GT(c[j * 4 + k], 0.0f);
      }
    }
    EXPECT_LT(worst, row_tol) << iters << " iterations";
  }
}

TEST(Mhc, PrePostHeadAgainstDirectFormulas) {
  const int hc = 4, dim = 128, mix = (2 + hc) * hc;
  std::vector<float> fn = randn(size_t(mix) * hc * dim, 13, 0.05f, false),
                     base = randn(mix, 14, 0.5f, false);
  std::vector<float> scale = {0.3f, 0.5f, 0.7f};
  HcParams p{hc, dim, 20, 1e-6f, 1e-6f, fn.data(), base.data(), scale.data()};
  std::vector<float> h = randn(size_t(hc) * dim, 15), y(dim), post(hc), comb(hc * hc);
  hc_pre(p, h.data(), y.data(), post.data(), comb.data());
  double ms = 0;
  for (float v : h) ms += double(v) * v;
  const double rs = 1.0 / std::sqrt(ms / (hc * dim) + 1e-6);
  std::vector<double> m(mix);
  for (int r = 0; r < mix; ++r) {
    for (int i = 0; i < hc * dim; ++i) m[r] += double(fn[size_t(r) * hc * dim + i]) * h[i];
    m[r] *= rs;
  }
  std::vector<double> want(dim);
  for (int j = 0; j < hc; ++j) {
    const double pre = 1 / (1 + std::exp(-(m[j] * scale[0] + base[j]))) + 1e-6;
    EXPECT_NEAR(post[j], 2 / (1 + std::exp(-(m[hc + j] * scale[1] + base[hc + j]))), 1e-5);
    for (int d = 0; d < dim; ++d) want[d] += pre * h[size_t(j) * dim + d];
  }
  EXPECT_LT(rel_l2(y, want), 5e-3);
  // hc_post: out[k] = post[k] x + sum_j comb[j][k] res[j]
  std::vector<float> x = randn(dim, 16), out(size_t(hc) * dim);
  hc_post(hc, dim, x.data(), h.data(), post.data(), comb.data(), out.data());
  for (int k = 0; k < hc; ++k)
    for (int d = 0; d < dim; ++d) {
      double w = double(post[k]) * x[d];
      for (int j = 0; j < hc; ++j) w += double(comb[j * hc + k]) * h[size_t(j) * dim + d];
      EXPECT_NEAR(out[size_t(k) * dim + d], w, std::fabs(w) / 128 + 1e-6);
    }
}

TEST(Linear, Fp8BlockGemmAgainstDirectSum) {
  for (int m : {1, 3, 17}) {
    const int N = 130, K = 256;
    std::vector<float> w(size_t(N) * K);
    std::mt19937 rng(17);
    std::uniform_int_distribution<int> code(0, 253);
    for (auto& v : w) {  // FP8 values times a per-block power of two
      uint8_t c = uint8_t(code(rng));
      if ((c & 0x7f) == 0x7f) c = 0x38;
      v = e4m3_to_float(c) * 0.0078125f;
    }
    Linear l = Linear::from_rows(LinearKind::kFp8, N, K, w);
    std::vector<float> x = randn(size_t(m) * K, 18 + m), y(size_t(m) * N, -1.0f);
    linear(l, x.data(), m, y.data());
    for (int r = 0; r < m; ++r) {
      std::vector<float> a(K);
      fake_quant_fp8(x.data() + size_t(r) * K, K, 128, a.data());
      for (int n = 0; n < N; ++n) {
        double ref = 0;
        for (int k = 0; k < K; ++k) ref += double(a[k]) * w[size_t(n) * K + k];
        EXPECT_NEAR(y[size_t(r) * N + n], ref, std::fabs(ref) / 128 + 1e-6);
        EXPECT_EQ(y[size_t(r) * N + n], round_bf16(y[size_t(r) * N + n]));
      }
    }
  }
}

TEST(Linear, RowResultIndependentOfBatch) {
  const int N = 64, K = 128;
  Linear l = Linear::from_rows(LinearKind::kFp4, N, K, randn(size_t(N) * K, 19));
  std::vector<float> x = randn(size_t(20) * K, 20), all(size_t(20) * N), one(N);
  linear(l, x.data(), 20, all.data());
  for (int r = 0; r < 20; ++r) {
    linear(l, x.data() + size_t(r) * K, 1, one.data());
    for (int n = 0; n < N; ++n) ASSERT_EQ(one[n], all[size_t(r) * N + n]);
  }
}

// Direct double-precision attention with the sink: the reference the kernel approximates.
std::vector<double> attention_exact(const std::vector<float>& q,
                                    const std::vector<const float*>& keys,
                                    const std::vector<float>& sink, int H, int D, float scale) {
  std::vector<double> o(size_t(H) * D);
  for (int h = 0; h < H; ++h) {
    double mx = -1e300;
    std::vector<double> s(keys.size());
    for (size_t j = 0; j < keys.size(); ++j) {
      if (!keys[j]) continue;
      for (int d = 0; d < D; ++d) s[j] += double(q[size_t(h) * D + d]) * keys[j][d];
      s[j] *= scale;
      mx = std::max(mx, s[j]);
    }
    double den = std::exp(sink[h] - mx);
    for (size_t j = 0; j < keys.size(); ++j)
      if (keys[j]) {
        const double e = std::exp(s[j] - mx);
        den += e;
        for (int d = 0; d < D; ++d) o[size_t(h) * D + d] += e * keys[j][d];
      }
    for (int d = 0; d < D; ++d) o[size_t(h) * D + d] /= den;
  }
  return o;
}

TEST(SparseAttention, MatchesExactSoftmaxWithSinkAndSkipsInvalid) {
  const int H = 4, D = 64;
  const float scale = 0.125f;
  for (int nkeys : {1, 63, 64, 65, 200}) {
    std::vector<float> q = randn(size_t(H) * D, 21), kv = randn(size_t(nkeys) * D, 22),
                       sink = {-1.0f, 0.5f, 2.0f, 4.0f};
    std::vector<const float*> keys;
    for (int j = 0; j < nkeys; ++j) {
      keys.push_back(kv.data() + size_t(j) * D);
      if (j % 5 == 3) keys.push_back(nullptr);  // -1 slots anywhere
    }
    std::vector<float> out(size_t(H) * D, std::numeric_limits<float>::quiet_NaN());
    SparseAttnParams p{H, D, scale, sink.data()};
    sparse_attention(p, q.data(), keys.data(), int(keys.size()), out.data());
    EXPECT_LT(rel_l2(out, attention_exact(q, keys, sink, H, D, scale)), 5e-3) << nkeys;
  }
  // Only invalid keys: nothing but the sink, output zero.
  std::vector<float> q = randn(size_t(H) * D, 23), out(size_t(H) * D, 7.0f), sink(H, 0.0f);
  std::vector<const float*> none(70, nullptr);
  SparseAttnParams p{H, D, scale, sink.data()};
  sparse_attention(p, q.data(), none.data(), 70, out.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST(Indexer, ScoresAndTopkTiesToLowerIndex) {
  const int H = 4, D = 128, T = 50;
  std::vector<float> q = randn(size_t(H) * D, 24), w = randn(H, 25),
                     keys = randn(size_t(T) * D, 26), s(T);
  indexer_scores(q.data(), w.data(), H, D, keys.data(), T, s.data());
  for (int t = 0; t < T; ++t) {
    double want = 0, mag = 0;
    for (int h = 0; h < H; ++h) {
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += double(q[size_t(h) * D + d]) * keys[size_t(t) * D + d];
      want += std::max(dot, 0.0) * w[h];
      mag += std::fabs(std::max(dot, 0.0) * w[h]);
    }
    // Each head's term is rounded to BF16 twice, the sum once.
    EXPECT_NEAR(s[t], want, mag / 64 + std::fabs(want) / 128 + 1e-6);
  }
  const float sc[6] = {1.0f, 3.0f, 2.0f, 3.0f, 2.0f, -1.0f};
  int32_t out[6];
  ASSERT_EQ(topk_desc(sc, 6, 4, out), 4);
  EXPECT_EQ(std::vector<int32_t>(out, out + 4), (std::vector<int32_t>{1, 3, 2, 4}));
  EXPECT_EQ(topk_desc(sc, 6, 10, out), 6);
  EXPECT_EQ(topk_desc(sc, 0, 4, out), 0);
}

TEST(CacheCodec, KvEntryIs584BytesAndExact) {
  const KvEntryLayout l;
  EXPECT_EQ(l.data_bytes(), 576);
  EXPECT_EQ(l.scale_bytes(), 8);
  EXPECT_EQ(l.entry_bytes(), 584);
  EXPECT_EQ(l.page_bytes(64) % 576, 0);
  EXPECT_EQ(l.page_bytes(64), 37440);  // 64*584 = 37376, padded to a multiple of 576
  EXPECT_EQ(l.scale_offset(64, 3), 64 * 576 + 24);
  std::vector<float> kv = randn(512, 27, 2.0f), back(512);
  std::vector<uint8_t> data(576), scales(8, 0xee);
  encode_kv_entry(l, kv.data(), data.data(), scales.data());
  EXPECT_EQ(scales[7], 0);  // pad byte
  decode_kv_entry(l, data.data(), scales.data(), back.data());
  std::vector<float> fq(448);
  fake_quant_fp8(kv.data(), 448, 64, fq.data());
  for (int i = 0; i < 448; ++i) EXPECT_EQ(back[i], fq[i]);
  for (int i = 448; i < 512; ++i) EXPECT_EQ(back[i], kv[i]);  // RoPE dims stay BF16
  // Encoding a decoded entry reproduces its bytes.
  std::vector<uint8_t> data2(576), scales2(8);
  encode_kv_entry(l, back.data(), data2.data(), scales2.data());
  EXPECT_EQ(data, data2);
  EXPECT_EQ(scales, scales2);
}

TEST(CacheCodec, IndexKeyIsMxfp4AndExact) {
  const IndexKeyLayout l;
  EXPECT_EQ(l.entry_bytes(), 68);
  std::vector<float> k = randn(128, 28), back(128), fq(128);
  std::vector<uint8_t> data(64), scales(4);
  encode_index_key(l, k.data(), data.data(), scales.data());
  decode_index_key(l, data.data(), scales.data(), back.data());
  fake_quant_fp4(k.data(), 128, 32, fq.data());
  EXPECT_EQ(back, fq);
}

// The compressor's pooled entry from its state: per channel, a softmax over the block's
// scores (ratio 4: previous block's first half, this block's second half).
TEST(Compressor, PoolingMatchesDefinition) {
  for (int ratio : {4, 128}) {
    const int d = 64, coff = ratio == 4 ? 2 : 1, width = coff * d, dim = 32;
    CompressorWeights w;
    w.ratio = ratio;
    w.dim = d;
    w.ape = randn(size_t(ratio) * width, 29, 0.5f, false);
    CompressorStateLayout l{ratio, d};
    std::vector<float> st(l.floats());
    std::fill(st.begin(), st.begin() + l.score_offset(0), 0.0f);
    std::fill(st.begin() + l.score_offset(0), st.end(), -std::numeric_limits<float>::infinity());
    const int T = 3 * ratio;
    std::vector<float> a = randn(size_t(T) * width, 30, 1.0f, false),
                       g = randn(size_t(T) * width, 31, 1.0f, false);
    (void)dim;
    for (int t = 0; t < T; ++t) {
      compressor_store(w, l, st.data(), t, a.data() + size_t(t) * width,
                       g.data() + size_t(t) * width);
      if ((t + 1) % ratio) continue;
      std::vector<float> pooled(d);
      compressor_pool(w, l, st.data(), pooled.data());
      const int blk = t / ratio;
      for (int ch = 0; ch < d; ++ch) {
        std::vector<std::pair<double, double>> items;  // (score, value)
        auto add = [&](int tok, int col) {
          items.push_back(
              {double(g[size_t(tok) * width + col]) + w.ape[size_t(tok % ratio) * width + col],
               a[size_t(tok) * width + col]});
        };
        if (ratio == 4 && blk > 0)
          for (int tok = (blk - 1) * 4; tok < blk * 4; ++tok) add(tok, ch);
        for (int tok = blk * ratio; tok < (blk + 1) * ratio; ++tok)
          add(tok, ratio == 4 ? d + ch : ch);
        double mx = -1e300, den = 0, num = 0;
        for (auto& [s, v] : items) mx = std::max(mx, s);
        for (auto& [s, v] : items) den += std::exp(s - mx), num += std::exp(s - mx) * v;
        EXPECT_NEAR(pooled[ch], num / den, 1e-5 * (1 + std::fabs(num / den)))
            << ratio << " " << blk;
      }
    }
  }
}

// The router score: every fp32 operation of the formula correctly rounded (the CUDA router
// computes the same bits): against the same formula with exp / log1p in long double, rounded
// once to fp32 (the two roundings differ only within ~2^-29 of an fp32 midpoint).
TEST(Moe, ScoreEveryOperationCorrectlyRounded) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> d(-30.0f, 30.0f);
  int differ = 0;
  for (int i = 0; i < 20000; ++i) {
    const float l = i == 0 ? 20.0f : i == 1 ? std::nextafter(20.0f, 0.0f) : d(rng);
    const float e = static_cast<float>(std::exp(static_cast<long double>(l)));
    const float sp = l > 20.0f ? l : static_cast<float>(std::log1p(static_cast<long double>(e)));
    const float want_sp = std::sqrt(sp);
    const float em = static_cast<float>(std::exp(-static_cast<long double>(l)));
    const float want_sg = 1.0f / (1.0f + em);
    differ += moe_score(ScoreFunc::kSqrtSoftplus, l) != want_sp;
    differ += moe_score(ScoreFunc::kSigmoid, l) != want_sg;
  }
  EXPECT_EQ(differ, 0);
  EXPECT_THROW(moe_score(ScoreFunc::kSoftmax, 0.0f), Error);
}

TEST(Moe, RoutingSqrtSoftplusBiasAndHash) {
  const int E = 8, dim = 128, K = 2;
  MoeWeights w;
  w.gate = Linear::from_rows(LinearKind::kF32, E, dim, randn(size_t(E) * dim, 32, 0.1f, false));
  w.bias = std::vector<float>(E, 0.0f);
  w.bias[5] = 100.0f;  // bias only steers selection, never the weight
  MoeParams p{K, ScoreFunc::kSqrtSoftplus, 1.5f, 10.0f};
  std::vector<float> x = randn(dim, 33);
  int32_t sel[K];
  float wt[K];
  moe_route(w, p, x.data(), 0, sel, wt);
  EXPECT_EQ(sel[0], 5);
  std::vector<double> s(E);
  for (int e = 0; e < E; ++e) {
    double l = 0;
    for (int i = 0; i < dim; ++i) l += double(w.gate.wt[size_t(i) * E + e]) * x[i];
    s[e] = std::sqrt(std::log1p(std::exp(l)));
  }
  EXPECT_NEAR(wt[0] + wt[1], 1.5, 1e-5);
  EXPECT_NEAR(wt[0] / wt[1], s[sel[0]] / s[sel[1]], 1e-5);
  // Hash routing: fixed experts from the token id, weights still from the scores.
  w.bias.clear();
  w.tid2eid = {1, 6, 3, 3};  // token 1 lists expert 3 twice
  moe_route(w, p, x.data(), 0, sel, wt);
  EXPECT_EQ(sel[0], 1);
  EXPECT_EQ(sel[1], 6);
  EXPECT_NEAR(wt[0] / wt[1], s[1] / s[6], 1e-5);
}

}  // namespace
}  // namespace dsv4::cpu
