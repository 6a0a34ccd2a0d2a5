// The reference sampler against its rules (ops/common/sampling.h): greedy ties, bias and
// penalties, the filters, the draw's distribution and its dependence on (seed, index) alone,
// logprobs of the raw row, forced tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/cpu/sampler.h"

namespace dsv4::test {
namespace {

using cpu::sample_row;

SamplingParams greedy() {
  return SamplingParams{};
}

SamplingParams temp(float t, uint64_t seed = 1) {
  SamplingParams p;
  p.temperature = t;
  p.seed = seed;
  return p;
}

TEST(Sampler, GreedyTakesTheFirstLargest) {
  const std::vector<float> z = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(sample_row(z.data(), 4, greedy(), 0, nullptr).id, 1);
}

TEST(Sampler, LogitBiasMovesGreedy) {
  const std::vector<float> z = {0.5f, 2.0f, -1.0f, 1.9f};
  SamplingParams p;
  p.logit_bias = {{3, 0.2f}};
  EXPECT_EQ(sample_row(z.data(), 4, p, 0, nullptr).id, 3);
  p.logit_bias = {{1, -100.0f}};
  EXPECT_EQ(sample_row(z.data(), 4, p, 0, nullptr).id, 3);
}

TEST(Sampler, PenaltiesFollowTheirRules) {
  const std::vector<float> z = {3.0f, 2.5f, -1.0f, 2.9f};
  TokenCounts counts;
  counts.output = {{0, 2}};
  counts.prompt = {2};
  SamplingParams p;
  // frequency: 3.0 - 0.2 * 2 = 2.6 < 2.9
  p.frequency_penalty = 0.2f;
  EXPECT_EQ(sample_row(z.data(), 4, p, 0, &counts).id, 3);
  // presence: once, whatever the count: 3.0 - 0.05 = 2.95 > 2.9
  p = SamplingParams{};
  p.presence_penalty = 0.05f;
  EXPECT_EQ(sample_row(z.data(), 4, p, 0, &counts).id, 0);
  // repetition: positive logits divided (3.0 / 1.1 < 2.9); prompt tokens count too, negative
  // ones multiplied (token 2 at -1 goes to -1.1, checked through the logprob below).
  p = SamplingParams{};
  p.repetition_penalty = 1.1f;
  EXPECT_EQ(sample_row(z.data(), 4, p, 0, &counts).id, 3);
  const std::vector<float> neg = {-1.0f, -1.05f};
  TokenCounts c2;
  c2.prompt = {0};
  EXPECT_EQ(sample_row(neg.data(), 2, p, 0, &c2).id, 1);  // -1.1 < -1.05
  // No history: no penalty.
  EXPECT_EQ(sample_row(z.data(), 4, p, 0, nullptr).id, 0);
}

TEST(Sampler, DrawDependsOnSeedAndIndexOnly) {
  std::vector<float> z(64);
  for (int i = 0; i < 64; ++i) z[size_t(i)] = std::sin(float(i)) * 2;
  const SamplingParams p = temp(1.0f, 42);
  for (int64_t i = 0; i < 20; ++i)
    EXPECT_EQ(sample_row(z.data(), 64, p, i, nullptr).id,
              sample_row(z.data(), 64, p, i, nullptr).id);
  int differ = 0, seed_differ = 0;
  for (int64_t i = 0; i < 200; ++i) {
    differ += sample_row(z.data(), 64, p, i, nullptr).id !=
              sample_row(z.data(), 64, p, i + 1, nullptr).id;
    seed_differ += sample_row(z.data(), 64, p, i, nullptr).id !=
                   sample_row(z.data(), 64, temp(1.0f, 43), i, nullptr).id;
  }
  // The largest probability here is below 0.2, so equal draws at two counters happen less
  // than ~20 % of the time; 100 of 200 is far beyond chance.
  EXPECT_GT(differ, 100);
  EXPECT_GT(seed_differ, 100);
}

// Frequencies of the draw over many counters against softmax(z / T): each within 5 standard
// deviations sqrt(p (1 - p) / N).
void expect_distribution(const std::vector<float>& z, const SamplingParams& p,
                         const std::vector<double>& want) {
  const int N = 20000, V = int(z.size());
  std::vector<int> hits(size_t(V), 0);
  for (int i = 0; i < N; ++i) ++hits[size_t(sample_row(z.data(), V, p, i, nullptr).id)];
  for (int t = 0; t < V; ++t) {
    const double f = double(hits[size_t(t)]) / N, q = want[size_t(t)];
    const double sd = std::sqrt(std::max(q * (1 - q), 1e-12) / N);
    if (q == 0)
      EXPECT_EQ(hits[size_t(t)], 0) << "token " << t;
    else
      EXPECT_NEAR(f, q, 5 * sd) << "token " << t;
  }
}

TEST(Sampler, DrawFollowsTheSoftmax) {
  const std::vector<float> z = {1.0f, 0.0f, -1.0f, 0.5f};
  for (float T : {1.0f, 0.5f, 2.0f}) {
    std::vector<double> want(4);
    double s = 0;
    for (int i = 0; i < 4; ++i) s += want[size_t(i)] = std::exp(double(z[size_t(i)]) / T);
    for (double& w : want) w /= s;
    expect_distribution(z, temp(T, 7), want);
  }
}

TEST(Sampler, FiltersKeepWhatTheirRulesKeep) {
  // softmax at T = 1 of log([0.5, 0.3, 0.15, 0.05]).
  const std::vector<float> z = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingParams p = temp(1.0f, 3);
  p.top_k = 2;
  expect_distribution(z, p, {0.625, 0.375, 0, 0});
  p = temp(1.0f, 3);
  p.top_p = 0.7f;  // 0.5 < 0.7 <= 0.8: the first two
  expect_distribution(z, p, {0.625, 0.375, 0, 0});
  p = temp(1.0f, 3);
  p.top_p = 0.85f;  // 0.8 < 0.85 <= 0.95: three
  expect_distribution(z, p, {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0});
  p = temp(1.0f, 3);
  p.min_p = 0.5f;  // p >= 0.25: two
  expect_distribution(z, p, {0.625, 0.375, 0, 0});
  // The extremes are greedy.
  for (auto set : {+[](SamplingParams& q) { q.top_k = 1; }, +[](SamplingParams& q) { q.min_p = 1; },
                   +[](SamplingParams& q) { q.top_p = 1e-6f; }}) {
    SamplingParams g = temp(1.0f, 11);
    set(g);
    for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(sample_row(z.data(), 4, g, i, nullptr).id, 0);
  }
}

TEST(Sampler, TopKKeepsTiesWithTheKth) {
  const std::vector<float> z = {1.0f, 0.0f, 0.0f, -5.0f};
  SamplingParams p = temp(1.0f, 5);
  p.top_k = 2;
  const double e0 = std::exp(1.0), e1 = 1.0, s = e0 + 2 * e1;
  expect_distribution(z, p, {e0 / s, e1 / s, e1 / s, 0});
}

TEST(Sampler, LogprobsAreTheRawRowsLogSoftmax) {
  const std::vector<float> z = {1.0f, 3.0f, 2.0f, -4.0f};
  double lse = 0;
  for (float v : z) lse += std::exp(double(v));
  lse = std::log(lse);
  SamplingParams p;
  p.logprobs = true;
  p.top_logprobs = 3;
  p.logit_bias = {{0, 10.0f}};  // changes the choice, not the logprobs
  const SampledToken t = sample_row(z.data(), 4, p, 0, nullptr);
  EXPECT_EQ(t.id, 0);
  EXPECT_NEAR(t.logprob, 1.0 - lse, 1e-6);
  ASSERT_EQ(t.top.size(), 3u);
  EXPECT_EQ(t.top[0].first, 1);
  EXPECT_EQ(t.top[1].first, 2);
  EXPECT_EQ(t.top[2].first, 0);
  EXPECT_NEAR(t.top[0].second, 3.0 - lse, 1e-6);
  // Forced: the given id, with its own logprob.
  const SampledToken f = sample_row(z.data(), 4, p, 0, nullptr, 3);
  EXPECT_EQ(f.id, 3);
  EXPECT_NEAR(f.logprob, -4.0 - lse, 1e-6);
}

TEST(Sampler, BadParametersAreErrors) {
  const std::vector<float> z = {1.0f, 2.0f};
  SamplingParams p;
  p.top_logprobs = 21;
  EXPECT_THROW(sample_row(z.data(), 2, p, 0, nullptr), Error);
  p = SamplingParams{};
  p.logit_bias = {{2, 1.0f}};
  EXPECT_THROW(sample_row(z.data(), 2, p, 0, nullptr), Error);
  EXPECT_THROW(sample_row(z.data(), 2, SamplingParams{}, 0, nullptr, 2), Error);
}

}  // namespace
}  // namespace dsv4::test
