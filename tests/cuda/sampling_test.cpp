// GPU sampling (ops/cuda/sampling) against the reference sampler (cpu::sample_row,
// cpu::score_row) on fresh random rows at the real vocabulary (129,280) and at 1, 7 and 1000:
// every parameter alone and combined, many seeds and indices, ties, forced ids, scores,
// non-finite rows, poisoned results, invalid inputs; and CudaRunner's wiring on a make-tiny
// model (which rows are sampled and scored, the logits downloaded before rows are patched).
//
// Chosen ids must be equal. They could differ only where fp64 exp/log (one ulp apart at most
// between CUDA and glibc) or the order of the top-p sums decides a comparison (sampling.cu); on
// random rows that has a probability of order 1e-11 per draw, so any difference here is a bug.
// Top ids must be equal (they come from comparisons of the raw fp32 values). Logprobs are
// float(double(z) - lse) on both sides; logprob_bound() derives how far apart they can be.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "cuda/engine_test_support.h"
#include "cuda/gpu_test.h"
#include "model/tiny_checkpoint.h"
#include "ops/cpu/sampler.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/sampling/device_sampler.h"
#include "support/temp_dir.h"

namespace dsv4 {
namespace {

using cuda::DeviceBuffer;
using cuda::DeviceSampler;

constexpr int kVocab = 129280;

class CudaSampling : public test::GpuTest {};

// One sampled row.
struct Case {
  SamplingParams params;
  TokenCounts counts;
  bool has_counts = false;
  int64_t index = 0;
  int32_t forced = -1;
};

// The largest |GPU - CPU| of a logprob float(double(z) - lse), z a row value, lse the row's
// log-sum-exp m + log(s), s = sum of n terms exp(double(z_i) - m) in (0, 1]:
//  - each term is within one ulp (2^-52 relative) on either side (CUDA's and glibc's exp), each
//    sum in its own order within (n - 1) 2^-53 relative, so the two s differ by at most
//    2 (n + 1) 2^-53 relative (to first order; the factor 1.001 covers the rest), their logs
//    by as much absolutely, plus one ulp of log(s) each, plus one ulp of lse each for m + log(s);
//  - z - lse rounds to fp64 (one ulp of it, each side), then to fp32: two reals d apart round to
//    fp32 values at most d plus one fp32 spacing (at their magnitude) apart.
double logprob_bound(float ref, double lse, double log_s, int n) {
  const double eps = 0x1p-53;
  const double d = 1.001 * 2 * (n + 1) * eps + 4 * eps * std::fabs(log_s) +
                   4 * eps * std::fabs(lse) + 4 * eps * (std::fabs(double(ref)) + 1);
  const float hi = float(std::fabs(double(ref)) + d);
  const double spacing =
      double(std::nextafter(hi, std::numeric_limits<float>::infinity())) - double(hi);
  return d + spacing;
}

struct RowLse {
  double lse = 0, log_s = 0;
};
RowLse row_lse(const float* z, int n) {
  const float m = z[cpu::argmax(z, n)];
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(double(z[i]) - double(m));
  return {double(m) + std::log(s), std::log(s)};
}

int first_nonfinite(const float* z, int n) {
  for (int i = 0; i < n; ++i)
    if (!std::isfinite(z[i])) return i;
  return -1;
}

uint32_t bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

std::string describe(const Case& c, int row) {
  const SamplingParams& p = c.params;
  return cat("row ", row, ": T=", p.temperature, " top_k=", p.top_k, " top_p=", p.top_p,
             " min_p=", p.min_p, " rep=", p.repetition_penalty, " freq=", p.frequency_penalty,
             " pres=", p.presence_penalty, " bias=", p.logit_bias.size(), " seed=", p.seed,
             " index=", c.index, " forced=", c.forced, " counts=", c.has_counts);
}

void expect_same_token(const SampledToken& got, const SampledToken& ref, const float* z, int n,
                       const std::string& what) {
  ASSERT_EQ(got.id, ref.id) << what;
  ASSERT_EQ(got.top.size(), ref.top.size()) << what;
  if (ref.id < 0) return;
  const RowLse l = row_lse(z, n);
  EXPECT_LE(std::fabs(double(got.logprob) - double(ref.logprob)),
            logprob_bound(ref.logprob, l.lse, l.log_s, n))
      << what << ": logprob " << got.logprob << " vs " << ref.logprob;
  for (size_t a = 0; a < ref.top.size(); ++a) {
    EXPECT_EQ(got.top[a].first, ref.top[a].first) << what << ": top " << a;
    EXPECT_LE(std::fabs(double(got.top[a].second) - double(ref.top[a].second)),
              logprob_bound(ref.top[a].second, l.lse, l.log_s, n))
        << what << ": top " << a;
  }
}

// Samples row i with cases[i] (rows beyond the cases are only checked for non-finite values)
// and scores `scores`, on the device and on the CPU; every result must agree.
void run_and_compare(int V, const std::vector<float>& logits, const std::vector<Case>& cases,
                     const std::vector<DeviceSampler::Score>& scores = {}) {
  const int rows = int(logits.size() / size_t(V));
  ASSERT_GE(rows, int(cases.size()));
  DeviceSampler sampler(V, rows, std::max<int>(1, int(cases.size())));
  DeviceBuffer<float> d(logits);
  std::vector<DeviceSampler::Sample> samples;
  for (size_t i = 0; i < cases.size(); ++i)
    samples.push_back({int(i), &cases[i].params, cases[i].index,
                       cases[i].has_counts ? &cases[i].counts : nullptr, cases[i].forced});
  sampler.stage(rows, samples, scores);
  sampler.fill_results(0xff);  // poisoned: every result read must have been written
  sampler.launch(d.data(), nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  for (int r = 0; r < rows; ++r) {
    const float* z = logits.data() + size_t(r) * V;
    const int bad = first_nonfinite(z, V);
    ASSERT_EQ(sampler.nonfinite_index(r), bad) << "row " << r;
    if (bad >= 0) {
      EXPECT_EQ(bits(sampler.nonfinite_value(r)), bits(z[bad])) << "row " << r;
    }
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const float* z = logits.data() + i * size_t(V);
    const std::string what = describe(cases[i], int(i));
    if (first_nonfinite(z, V) >= 0) {
      EXPECT_EQ(sampler.sample(int(i)).id, -1) << what;
      continue;
    }
    const Case& c = cases[i];
    const SampledToken ref =
        cpu::sample_row(z, V, c.params, c.index, c.has_counts ? &c.counts : nullptr, c.forced);
    expect_same_token(sampler.sample(int(i)), ref, z, V, what);
  }
  for (size_t i = 0; i < scores.size(); ++i) {
    const float* z = logits.data() + size_t(scores[i].row) * V;
    const std::string what = cat("score ", i, " row ", scores[i].row, " id ", scores[i].id);
    if (first_nonfinite(z, V) >= 0) {
      EXPECT_EQ(sampler.score(int(i)).id, -1) << what;
      continue;
    }
    expect_same_token(sampler.score(int(i)), cpu::score_row(z, V, scores[i].id, scores[i].top), z,
                      V, what);
  }
}

// Rows of normal logits, each with its own scale (flat to peaked).
std::vector<float> random_rows(int rows, int V, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> z(size_t(rows) * V);
  for (int r = 0; r < rows; ++r) {
    const double scale = std::ldexp(1.0, int(rng.below(5)) - 1);  // 0.5 .. 8
    for (int i = 0; i < V; ++i) z[size_t(r) * V + i] = float(rng.normal() * scale);
  }
  return z;
}

// Rows with many ties: values on a coarse grid, +0 and -0 both present.
std::vector<float> tied_rows(int rows, int V, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> z(size_t(rows) * V);
  for (float& x : z) {
    x = float(std::round(rng.normal() * 2) / 2);
    if (x == 0) x = rng.below(2) ? 0.0f : -0.0f;
  }
  return z;
}

TokenCounts random_counts(Rng& rng, int V, int outputs, int prompt) {
  TokenCounts c;
  std::vector<char> seen(size_t(V), 0);
  for (int i = 0; i < outputs && i < V; ++i) {
    const int32_t t = int32_t(rng.below(uint64_t(V)));
    if (seen[size_t(t)]) continue;
    seen[size_t(t)] = 1;
    c.output.push_back({t, int32_t(rng.below(4))});  // counts 0..3
  }
  std::vector<char> in_prompt(size_t(V), 0);
  for (int i = 0; i < prompt; ++i) {
    const int32_t t = int32_t(rng.below(uint64_t(V)));
    if (!in_prompt[size_t(t)]) in_prompt[size_t(t)] = 1, c.prompt.push_back(t);
  }
  return c;
}

// `rows` cases of `p`, each with its own seed and output index.
std::vector<Case> cases_of(const SamplingParams& p, int rows, uint64_t seed) {
  std::vector<Case> cs(static_cast<size_t>(rows));
  for (int i = 0; i < rows; ++i) {
    cs[size_t(i)].params = p;
    cs[size_t(i)].params.seed = seed * 1000003 + uint64_t(i);
    cs[size_t(i)].index = int64_t(i) * 7 + int64_t(seed % 5);
  }
  return cs;
}

// Every parameter alone, then with logprobs, at vocabulary size V.
std::vector<SamplingParams> single_parameters(int V) {
  std::vector<SamplingParams> ps;
  auto with = [&](auto set) {
    SamplingParams p;
    set(p);
    ps.push_back(p);
  };
  with([](SamplingParams&) {});  // greedy
  for (float t : {0.3f, 1.0f, 1.7f}) with([&](SamplingParams& p) { p.temperature = t; });
  for (int k : {1, 2, 40, V - 1, V, V + 3})
    with([&](SamplingParams& p) { p.temperature = 1, p.top_k = std::max(k, 1); });
  for (float tp : {0.05f, 0.5f, 0.9f, 0.999f})
    with([&](SamplingParams& p) { p.temperature = 1, p.top_p = tp; });
  for (float mp : {0.01f, 0.2f, 1.0f})
    with([&](SamplingParams& p) { p.temperature = 1, p.min_p = mp; });
  for (float t : {0.0f, 1.0f}) {
    for (float r : {1.3f, 0.7f})
      with([&](SamplingParams& p) { p.temperature = t, p.repetition_penalty = r; });
    with([&](SamplingParams& p) { p.temperature = t, p.frequency_penalty = 0.5f; });
    with([&](SamplingParams& p) { p.temperature = t, p.frequency_penalty = -0.3f; });
    with([&](SamplingParams& p) { p.temperature = t, p.presence_penalty = 0.7f; });
    // Repeated bias entries of one token add in list order.
    with([&](SamplingParams& p) {
      p.temperature = t;
      p.logit_bias = {{V / 3, 1.5f}, {V - 1, 2.0f}, {V / 3, -0.25f}, {0, 3.0f}};
    });
  }
  const size_t n = ps.size();
  for (size_t i = 0; i < n; ++i) {
    SamplingParams p = ps[i];
    p.logprobs = true;
    p.top_logprobs = int(i % (kMaxTopLogprobs + 1));
    ps.push_back(p);
  }
  return ps;
}

void every_parameter_alone(int V, int rows_per_case, uint64_t seed) {
  Rng rng(seed);
  const std::vector<SamplingParams> ps = single_parameters(V);
  for (size_t k = 0; k < ps.size(); ++k) {
    std::vector<Case> cs = cases_of(ps[k], rows_per_case, seed + k);
    for (Case& c : cs) {
      c.has_counts = true;
      c.counts = random_counts(rng, V, 1 + int(rng.below(60)), int(rng.below(200)));
    }
    SCOPED_TRACE(cat("vocab ", V, " parameter set ", k));
    run_and_compare(V, random_rows(rows_per_case, V, seed * 31 + k), cs);
  }
}

TEST_F(CudaSampling, GreedyAtEverySize) {
  for (int V : {1, 7, 1000, kVocab}) {
    const int rows = V == kVocab ? 16 : 64;
    SamplingParams p;
    p.logprobs = true;
    p.top_logprobs = kMaxTopLogprobs;
    SCOPED_TRACE(cat("vocab ", V));
    run_and_compare(V, random_rows(rows, V, 11 + uint64_t(V)), cases_of(p, rows, 3));
  }
}

TEST_F(CudaSampling, EveryParameterAloneTinyVocabularies) {
  every_parameter_alone(1, 4, 5);
  every_parameter_alone(7, 32, 6);
  every_parameter_alone(1000, 16, 7);
}

TEST_F(CudaSampling, EveryParameterAloneRealVocabulary) {
  every_parameter_alone(kVocab, 4, 8);
}

// Random combinations of every parameter, one per row, over many seeds and indices.
TEST_F(CudaSampling, CombinedParameters) {
  for (int V : {7, 1000, kVocab}) {
    const int rows = V == kVocab ? 48 : 128;
    Rng rng(100 + uint64_t(V));
    std::vector<Case> cs(static_cast<size_t>(rows));
    for (int i = 0; i < rows; ++i) {
      SamplingParams& p = cs[size_t(i)].params;
      p.temperature = rng.below(6) == 0 ? 0.0f : float(rng.uniform(0.2, 2.0));
      if (rng.below(2)) p.top_k = 1 + int(rng.below(uint64_t(std::min(V, 200))));
      if (rng.below(2)) p.top_p = float(rng.uniform(0.05, 1.0));
      if (rng.below(3) == 0) p.min_p = float(rng.uniform(0.0, 0.3));
      if (rng.below(3) == 0) p.repetition_penalty = float(rng.uniform(0.5, 2.0));
      if (rng.below(3) == 0) p.frequency_penalty = float(rng.uniform(-1.0, 1.0));
      if (rng.below(3) == 0) p.presence_penalty = float(rng.uniform(-1.0, 1.0));
      for (int b = int(rng.below(4)); b > 0; --b)
        p.logit_bias.push_back({int32_t(rng.below(uint64_t(V))), float(rng.uniform(-5, 5))});
      p.seed = rng.below(uint64_t(1) << 62);
      p.logprobs = rng.below(2);
      p.top_logprobs = rng.below(2) ? int(rng.below(kMaxTopLogprobs + 1)) : 0;
      cs[size_t(i)].index = int64_t(rng.below(100000));
      cs[size_t(i)].has_counts = rng.below(4) != 0;
      cs[size_t(i)].counts = random_counts(rng, V, int(rng.below(300)), int(rng.below(2000)));
    }
    SCOPED_TRACE(cat("vocab ", V));
    run_and_compare(V, random_rows(rows, V, 200 + uint64_t(V)), cs);
  }
}

// One row, many draws: every output index of a seeded request gives the CPU's token.
TEST_F(CudaSampling, ManyIndicesOneRow) {
  const int V = kVocab, rows = 64;
  std::vector<float> one = random_rows(1, V, 77), z;
  for (int r = 0; r < rows; ++r) z.insert(z.end(), one.begin(), one.end());
  for (float tp : {1.0f, 0.9f}) {
    SamplingParams p;
    p.temperature = 0.8f;
    p.top_p = tp;
    p.top_k = tp < 1 ? 50 : 0;
    std::vector<Case> cs = cases_of(p, rows, 9);
    for (int i = 0; i < rows; ++i) cs[size_t(i)].params.seed = 1234, cs[size_t(i)].index = i;
    run_and_compare(V, z, cs);
  }
}

TEST_F(CudaSampling, Ties) {
  for (int V : {7, 1000, kVocab}) {
    const int rows = V == kVocab ? 8 : 32;
    std::vector<SamplingParams> ps;
    SamplingParams p;
    p.logprobs = true;
    p.top_logprobs = kMaxTopLogprobs;
    ps.push_back(p);  // greedy: the first of the tied largest; top: ties to the lower index
    p.temperature = 1;
    for (int k : {1, 2, 3, 10, 100}) {
      p.top_k = k;
      ps.push_back(p);
    }
    p.top_k = 0;
    for (float tp : {0.1f, 0.3f, 0.6f}) {
      p.top_p = tp;
      ps.push_back(p);
    }
    for (size_t k = 0; k < ps.size(); ++k) {
      SCOPED_TRACE(cat("vocab ", V, " set ", k));
      run_and_compare(V, tied_rows(rows, V, 300 + k), cases_of(ps[k], rows, 40 + k));
    }
  }
  // The top_n-th largest value tied at up to 1 .. 300 places (random places, a few may
  // coincide), around the number of ties the kernel collects in one pass (64; more take an
  // ordered scan): the reported ties must be the lowest indices. Vocabularies 129,280 and 1,001
  // (rows not 16-byte aligned: head and tail elements).
  for (int V : {kVocab, 1001}) {
    const int counts[] = {1, 2, 19, 63, 64, 65, 300};
    const int rows = int(std::size(counts));
    Rng rng(77);
    std::vector<float> z(size_t(rows) * V);
    for (int r = 0; r < rows; ++r) {
      float* row = z.data() + size_t(r) * V;
      for (int i = 0; i < V; ++i) row[i] = float(rng.uniform(-8, 4));
      for (int a = 0; a < 7; ++a) row[rng.below(uint64_t(V))] = 6.0f + 0.25f * float(a);
      for (int a = 0; a < counts[r]; ++a) row[rng.below(uint64_t(V))] = 5.5f;
    }
    SamplingParams tp;
    tp.logprobs = true;
    tp.top_logprobs = kMaxTopLogprobs;
    SCOPED_TRACE(cat("vocab ", V, " tied top_n-th value"));
    run_and_compare(V, z, cases_of(tp, rows, 5));
  }
  // The largest value tied on both sides of every boundary where a row can be split between
  // the blocks of its cluster (parts of ((V + p - 1) / p + 3) & ~3 logits, p = 1 .. 8 blocks:
  // 1, 2 and 4 rows cover several p on any GPU): argmax, top-k and the top alternatives must
  // still take the lowest indices.
  for (int V : {kVocab, 1001}) {
    for (int rows : {1, 2, 4}) {
      Rng rng(uint64_t(V) * 10 + uint64_t(rows));
      std::vector<float> z(size_t(rows) * V);
      for (int r = 0; r < rows; ++r) {
        float* row = z.data() + size_t(r) * V;
        for (int i = 0; i < V; ++i) row[i] = float(rng.uniform(-8, 4));
        for (int parts = 2; parts <= 8; ++parts) {
          const int chunk = ((V + parts - 1) / parts + 3) & ~3;
          for (int b = 1; b < parts && b * chunk < V; ++b) row[b * chunk - 1] = row[b * chunk] = 6;
        }
      }
      SamplingParams g;
      g.logprobs = true;
      g.top_logprobs = kMaxTopLogprobs;
      SamplingParams k = g;
      k.temperature = 1;
      k.top_k = 3;
      SCOPED_TRACE(cat("vocab ", V, " rows ", rows, " ties at block boundaries"));
      run_and_compare(V, z, cases_of(g, rows, 6));
      run_and_compare(V, z, cases_of(k, rows, 7));
    }
  }
  // Every value equal.
  std::vector<float> flat(size_t(4) * 1000, 1.25f);
  SamplingParams p;
  p.temperature = 1;
  p.top_k = 3;
  p.top_logprobs = 5;
  run_and_compare(1000, flat, cases_of(p, 4, 2));
}

TEST_F(CudaSampling, ForcedIds) {
  for (int V : {7, kVocab}) {
    const int rows = 16;
    Rng rng(5);
    SamplingParams p;
    p.temperature = 0.7f;
    p.logprobs = true;
    p.top_logprobs = 3;
    p.repetition_penalty = 1.5f;
    std::vector<Case> cs = cases_of(p, rows, 8);
    for (Case& c : cs) {
      c.forced = int32_t(rng.below(uint64_t(V)));
      // The forced token among the patched ones: its logprob is still of the raw row.
      c.has_counts = true;
      c.counts.output = {{c.forced, 2}};
      c.params.logit_bias = {{c.forced, 4.0f}};
    }
    run_and_compare(V, random_rows(rows, V, 9), cs);
  }
}

TEST_F(CudaSampling, Scores) {
  for (int V : {1, 7, kVocab}) {
    const int rows = 24;
    Rng rng(12);
    // The first 8 rows sampled (with logprobs), every other row scored as well.
    SamplingParams p;
    p.temperature = 1;
    p.logprobs = true;
    p.top_logprobs = 4;
    std::vector<DeviceSampler::Score> scores;
    for (int r = 0; r < rows; r += 2)
      scores.push_back({r, int32_t(rng.below(uint64_t(V))), int(rng.below(kMaxTopLogprobs + 1))});
    run_and_compare(V, random_rows(rows, V, 13), cases_of(p, 8, 14), scores);
  }
}

TEST_F(CudaSampling, NonFiniteRows) {
  for (int V : {1, 7, kVocab}) {
    const int rows = 12;
    std::vector<float> z = random_rows(rows, V, 15);
    Rng rng(16);
    const float poison[] = {
        std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::quiet_NaN()};
    for (int r = 0; r < rows; r += 2) {
      for (int k = 0; k < 3; ++k) z[size_t(r) * V + rng.below(uint64_t(V))] = poison[rng.below(4)];
    }
    if (V > 1) z[size_t(2) * V + size_t(V) - 1] = poison[1];  // the last index
    SamplingParams p;
    p.temperature = 0.9f;
    p.logprobs = true;
    p.top_logprobs = 2;
    std::vector<DeviceSampler::Score> scores;
    for (int r = 0; r < rows; ++r) scores.push_back({r, 0, 3});
    SCOPED_TRACE(cat("vocab ", V));
    run_and_compare(V, z, cases_of(p, 8, 17), scores);
  }
}

// Histories larger than the initial patch buffers (they grow), and two steps on one sampler.
TEST_F(CudaSampling, LargeHistoriesAndRepeatedSteps) {
  const int V = kVocab, rows = 3;
  Rng rng(18);
  SamplingParams p;
  p.temperature = 1.1f;
  p.top_p = 0.95f;
  p.repetition_penalty = 1.2f;
  p.frequency_penalty = 0.1f;
  p.presence_penalty = 0.2f;
  p.logprobs = true;
  std::vector<Case> cs = cases_of(p, rows, 19);
  for (Case& c : cs) c.has_counts = true, c.counts = random_counts(rng, V, 5000, 20000);
  const std::vector<float> z = random_rows(rows, V, 20);
  DeviceSampler sampler(V, rows, rows);
  std::vector<SampledToken> first;
  // Steps 0 and 1, then step 0 again: the same bits (the sums are order-independent).
  for (int step : {0, 1, 0}) {
    DeviceBuffer<float> d(z);
    std::vector<DeviceSampler::Sample> s;
    for (int i = 0; i < rows; ++i)
      s.push_back({i, &cs[size_t(i)].params, cs[size_t(i)].index + step, &cs[size_t(i)].counts});
    sampler.stage(rows, s, {});
    sampler.fill_results(0xff);
    sampler.launch(d.data(), nullptr);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < rows; ++i) {
      const SampledToken got = sampler.sample(i);
      const SampledToken ref = cpu::sample_row(z.data() + size_t(i) * V, V, cs[size_t(i)].params,
                                               cs[size_t(i)].index + step, &cs[size_t(i)].counts);
      expect_same_token(got, ref, z.data() + size_t(i) * V, V, cat("step ", step, " row ", i));
      if (first.size() < size_t(rows)) {
        first.push_back(got);
      } else if (step == 0) {
        EXPECT_EQ(got.id, first[size_t(i)].id);
        EXPECT_EQ(bits(got.logprob), bits(first[size_t(i)].logprob));
      }
    }
  }
}

// CudaRunner on a make-tiny model: samples and scores of logits rows that come back, and of
// rows that are only sampled or scored (read from the model's device logits after the step:
// they follow the returned rows in the step's row order, model/paged_runner.cpp), with bias
// and penalties (their rows patched in place after the download), in a prefill and a decode
// step; each equal to the reference sampler on the same row.
TEST_F(CudaSampling, RunnerSamplesAndScoresItsRows) {
  test::TempDir dir;
  write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kMxfp4, 42, dir.path(),
                        tiny_init("flash"));
  test::CudaStackOptions o;
  o.max_seqs = 4;
  o.max_context = 640;
  o.max_step_tokens = 64;
  std::unique_ptr<test::CudaStack> stack = test::open_cuda_stack(dir.path(), o);
  CudaRunner& r = *stack->runner;
  const int V = stack->V();
  Rng rng(3);
  auto tokens = [&](int n) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back(2 + int32_t(rng.below(uint64_t(V - 2))));
    return t;
  };
  auto device_rows = [&](int n) {
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    return test::fetch(static_cast<const float*>(r.model().logits()), size_t(n) * V);
  };
  auto row = [&](const std::vector<float>& all, int i) { return all.data() + size_t(i) * V; };
  const int x = r.open_sequence(), y = r.open_sequence(), z = r.open_sequence();
  const std::vector<int32_t> tx = tokens(20), ty = tokens(7), tz = tokens(5);

  // Prefill: x all logits, sampled with bias and penalties, every row but one scored; y its
  // last row, greedy; z no logits, sampled and every row scored.
  TokenCounts cx;
  cx.output = {{tx[3], 2}, {tx[5], 1}};
  for (int32_t t : tx)
    if (std::find(cx.prompt.begin(), cx.prompt.end(), t) == cx.prompt.end()) cx.prompt.push_back(t);
  SamplingParams px;
  px.temperature = 0.9f, px.top_k = 20, px.top_p = 0.9f, px.seed = 11;
  px.repetition_penalty = 1.2f, px.frequency_penalty = 0.3f, px.presence_penalty = 0.1f;
  px.logit_bias = {{tx[0], 1.0f}, {5, -2.0f}};
  px.logprobs = true, px.top_logprobs = 5;
  SamplingParams py;
  py.logprobs = true, py.top_logprobs = 2;
  SamplingParams pz;
  pz.temperature = 1.3f, pz.min_p = 0.05f, pz.seed = 12, pz.logprobs = true, pz.top_logprobs = 3;
  const SampleSpec sx{&px, 4, &cx, -1}, sy{&py, 0, nullptr, -1}, sz{&pz, 9, nullptr, -1};
  std::vector<StepInput> in(3);
  in[0] = StepInput(x, tx, true);
  in[0].sample = &sx;
  in[0].score = tokens(20);
  in[0].score[2] = -1;
  in[0].score_top = 3;
  in[1] = StepInput(y, ty);
  in[1].sample = &sy;
  in[2] = StepInput(z, tz);
  in[2].logits = false;
  in[2].sample = &sz;
  in[2].score = tokens(5);
  in[2].score_top = 4;
  StepOutput out = r.step(in);
  // Rows: x's 20, y's last (returned), then z's last (sampled, scored), z's rows 0..3 (scored).
  std::vector<float> dev = device_rows(26);
  ASSERT_EQ(out.logits.size(), size_t(21) * V);
  for (int i = 0; i < 21; ++i) {
    if (i == 19) continue;  // x's last row: patched in place after its download
    EXPECT_EQ(0, std::memcmp(row(out.logits, i), row(dev, i), size_t(V) * 4)) << "row " << i;
  }
  ASSERT_EQ(out.errors, std::vector<std::string>(3));
  ASSERT_EQ(out.samples.size(), 3u);
  ASSERT_EQ(out.scores.size(), 2u);
  expect_same_token(out.samples[0], cpu::sample_row(row(out.logits, 19), V, px, 4, &cx),
                    row(out.logits, 19), V, "prefill x sample");
  expect_same_token(out.samples[1], cpu::sample_row(row(out.logits, 20), V, py, 0, nullptr),
                    row(out.logits, 20), V, "prefill y sample");
  expect_same_token(out.samples[2], cpu::sample_row(row(dev, 21), V, pz, 9, nullptr), row(dev, 21),
                    V, "prefill z sample");
  ASSERT_EQ(out.scores[0].size(), 20u);
  for (int j = 0; j < 20; ++j) {
    if (j == 2) {
      EXPECT_EQ(out.scores[0][size_t(j)].id, -1);
      continue;
    }
    expect_same_token(out.scores[0][size_t(j)],
                      cpu::score_row(row(out.logits, j), V, in[0].score[size_t(j)], 3),
                      row(out.logits, j), V, cat("prefill x score ", j));
  }
  ASSERT_EQ(out.scores[1].size(), 5u);
  for (int j = 0; j < 5; ++j) {
    const int dr = j == 4 ? 21 : 22 + j;
    expect_same_token(out.scores[1][size_t(j)],
                      cpu::score_row(row(dev, dr), V, in[2].score[size_t(j)], 4), row(dev, dr), V,
                      cat("prefill z score ", j));
  }

  // Decode: x sampled only (top-k, no patches), y returned and greedy, z sampled only, greedy.
  SamplingParams px2;
  px2.temperature = 0.7f, px2.top_k = 3, px2.seed = 13;
  SamplingParams pz2;
  const SampleSpec sx2{&px2, 5, nullptr, -1}, sz2{&pz2, 10, nullptr, -1};
  std::vector<StepInput> d(3);
  d[0] = StepInput(x, tokens(1));
  d[0].logits = false;
  d[0].sample = &sx2;
  d[1] = StepInput(y, tokens(1));
  d[1].sample = &sy;
  d[2] = StepInput(z, tokens(1));
  d[2].logits = false;
  d[2].sample = &sz2;
  out = r.step(d);
  // Rows: y's (returned), then x's and z's.
  dev = device_rows(3);
  ASSERT_EQ(out.logits.size(), size_t(V));
  EXPECT_EQ(0, std::memcmp(out.logits.data(), dev.data(), size_t(V) * 4));
  ASSERT_EQ(out.samples.size(), 3u);
  expect_same_token(out.samples[0], cpu::sample_row(row(dev, 1), V, px2, 5, nullptr), row(dev, 1),
                    V, "decode x sample");
  expect_same_token(out.samples[1], cpu::sample_row(row(dev, 0), V, py, 0, nullptr), row(dev, 0), V,
                    "decode y sample");
  expect_same_token(out.samples[2], cpu::sample_row(row(dev, 2), V, pz2, 10, nullptr), row(dev, 2),
                    V, "decode z sample");
}

TEST_F(CudaSampling, InvalidInputsRejected) {
  const int V = 100;
  DeviceSampler sampler(V, 4, 2);
  auto rejects = [&](const SamplingParams& p, int row = 0, const TokenCounts* c = nullptr,
                     int32_t forced = -1) {
    EXPECT_THROW(sampler.stage(4, {{row, &p, 0, c, forced}}, {}), Error);
  };
  SamplingParams ok;
  EXPECT_NO_THROW(sampler.stage(4, {{0, &ok, 0, nullptr, -1}}, {}));
  SamplingParams p = ok;
  p.temperature = -1;
  rejects(p);
  p.temperature = std::numeric_limits<float>::quiet_NaN();
  rejects(p);
  p = ok, p.top_k = -1, rejects(p);
  p = ok, p.top_p = 0, rejects(p);
  p = ok, p.top_p = 1.5f, rejects(p);
  p = ok, p.min_p = -0.1f, rejects(p);
  p = ok, p.min_p = 1.1f, rejects(p);
  p = ok, p.repetition_penalty = 0, rejects(p);
  p = ok, p.frequency_penalty = std::numeric_limits<float>::infinity(), rejects(p);
  p = ok, p.top_logprobs = kMaxTopLogprobs + 1, rejects(p);
  p = ok, p.logit_bias = {{V, 1.0f}}, rejects(p);
  p = ok, p.logit_bias = {{-1, 1.0f}}, rejects(p);
  p = ok, p.logit_bias = {{3, std::numeric_limits<float>::quiet_NaN()}}, rejects(p);
  rejects(ok, 4);  // row out of range
  rejects(ok, -1);
  rejects(ok, 0, nullptr, V);  // forced out of range
  TokenCounts c;
  c.output = {{V, 1}};
  rejects(ok, 0, &c);
  c.output = {{1, -1}};
  rejects(ok, 0, &c);
  c.output = {};
  c.prompt = {V};
  rejects(ok, 0, &c);
  EXPECT_THROW(sampler.stage(4, {{0, nullptr, 0, nullptr, -1}}, {}), Error);
  EXPECT_THROW(sampler.stage(5, {}, {}), Error);  // more rows than planned
  EXPECT_THROW(sampler.stage(4, {{0, &ok, 0, nullptr, -1}, {0, &ok, 0, nullptr, -1}}, {}),
               Error);  // one row sampled twice
  EXPECT_THROW(
      sampler.stage(
          4, {{0, &ok, 0, nullptr, -1}, {1, &ok, 0, nullptr, -1}, {2, &ok, 0, nullptr, -1}}, {}),
      Error);  // more samples than planned
  EXPECT_THROW(sampler.stage(4, {}, {{0, V, 0}}), Error);
  EXPECT_THROW(sampler.stage(4, {}, {{0, -1, 0}}), Error);
  EXPECT_THROW(sampler.stage(4, {}, {{0, 1, kMaxTopLogprobs + 1}}), Error);
  EXPECT_THROW(sampler.stage(4, {}, {{4, 1, 0}}), Error);
  EXPECT_THROW(sampler.stage(4, {}, {{1, 1, 0}, {1, 2, 0}}), Error);
  // A failed stage leaves nothing to launch.
  DeviceBuffer<float> d(size_t(4) * V);
  EXPECT_THROW(sampler.launch(d.data(), nullptr), Error);
  EXPECT_THROW(cuda::DeviceSampler(0, 1, 1), Error);
}

}  // namespace
}  // namespace dsv4
