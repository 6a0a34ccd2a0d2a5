#include "ops/cpu/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace dsv4::cpu {

int32_t argmax(const float* x, int n) {
  int32_t best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

namespace {

// log-sum-exp of the raw row, in double.
double log_sum_exp(const float* z, int n) {
  const float m = z[argmax(z, n)];
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(double(z[i]) - double(m));
  return double(m) + std::log(s);
}

// The `k` largest values' indices, larger first, ties to the lower index.
std::vector<int32_t> top_indices(const float* z, int n, int k) {
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  k = std::min(k, n);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return z[a] != z[b] ? z[a] > z[b] : a < b; });
  idx.resize(size_t(k));
  return idx;
}

}  // namespace

SampledToken sample_row(const float* logits, int vocab, const SamplingParams& p, int64_t index,
                        const TokenCounts* counts, int32_t forced) {
  DSV4_CHECK(vocab > 0, "sampling an empty row");
  DSV4_CHECK(p.temperature >= 0 && std::isfinite(p.temperature), "temperature must be >= 0");
  DSV4_CHECK(p.top_logprobs >= 0 && p.top_logprobs <= kMaxTopLogprobs,
             "top_logprobs must be in [0, ", kMaxTopLogprobs, "]");
  SampledToken out;
  // 2-3. Bias and penalties on a copy.
  std::vector<float> z(logits, logits + vocab);
  for (const auto& [t, b] : p.logit_bias) {
    DSV4_CHECK(t >= 0 && t < vocab, "logit_bias token ", t, " out of range [0, ", vocab, ")");
    z[size_t(t)] += b;
  }
  if (counts && p.penalised()) {
    if (p.repetition_penalty != 1) {
      std::vector<char> seen(size_t(vocab), 0);
      for (int32_t t : counts->prompt) seen[size_t(t)] = 1;
      for (const auto& [t, c] : counts->output) seen[size_t(t)] = 1;
      for (int t = 0; t < vocab; ++t)
        if (seen[size_t(t)])
          z[size_t(t)] = z[size_t(t)] > 0 ? z[size_t(t)] / p.repetition_penalty
                                          : z[size_t(t)] * p.repetition_penalty;
    }
    for (const auto& [t, c] : counts->output)
      z[size_t(t)] -= p.frequency_penalty * float(c) + (c > 0 ? p.presence_penalty : 0.0f);
  }
  // 4-5. The choice.
  if (forced >= 0) {
    DSV4_CHECK(forced < vocab, "forced token ", forced, " out of range [0, ", vocab, ")");
    out.id = forced;
  } else if (p.temperature == 0) {
    out.id = argmax(z.data(), vocab);
  } else {
    const float zmax = z[size_t(argmax(z.data(), vocab))];
    std::vector<double> e(static_cast<size_t>(vocab));
    for (int t = 0; t < vocab; ++t)
      e[size_t(t)] = std::exp(double((z[size_t(t)] - zmax) / p.temperature));
    // Kept tokens: e >= threshold (the largest e is 1 and always kept).
    double threshold = p.min_p > 0 ? double(p.min_p) : 0.0;
    std::vector<int32_t> kept;
    for (int t = 0; t < vocab; ++t)
      if (e[size_t(t)] >= threshold) kept.push_back(t);
    auto by_e = [&](int32_t a, int32_t b) {
      return e[size_t(a)] != e[size_t(b)] ? e[size_t(a)] > e[size_t(b)] : a < b;
    };
    if (p.top_k > 0 && size_t(p.top_k) < kept.size()) {
      std::nth_element(kept.begin(), kept.begin() + (p.top_k - 1), kept.end(), by_e);
      threshold = std::max(threshold, e[size_t(kept[size_t(p.top_k - 1)])]);
    }
    if (p.top_p < 1) {
      std::vector<int32_t> order;
      for (int32_t t : kept)
        if (e[size_t(t)] >= threshold) order.push_back(t);
      std::sort(order.begin(), order.end(), by_e);
      double mass = 0;
      for (int32_t t : order) mass += e[size_t(t)];
      double cum = 0;
      for (int32_t t : order) {
        cum += e[size_t(t)];
        if (cum >= double(p.top_p) * mass) {
          threshold = std::max(threshold, e[size_t(t)]);
          break;
        }
      }
    }
    double best = -1;
    for (int32_t t : kept) {
      if (e[size_t(t)] < threshold) continue;
      const double v = e[size_t(t)] / -std::log(sample_uniform(p.seed, index, t));
      if (v > best) best = v, out.id = t;
    }
  }
  // 1. Logprobs of the raw row.
  if (p.logprobs || p.top_logprobs > 0) {
    SampledToken s = score_row(logits, vocab, out.id, p.top_logprobs);
    out.logprob = s.logprob;
    out.top = std::move(s.top);
  }
  return out;
}

SampledToken score_row(const float* logits, int vocab, int32_t token, int top) {
  DSV4_CHECK(token >= 0 && token < vocab, "scored token ", token, " out of range [0, ", vocab, ")");
  DSV4_CHECK(top >= 0 && top <= kMaxTopLogprobs, "top must be in [0, ", kMaxTopLogprobs, "]");
  const double lse = log_sum_exp(logits, vocab);
  SampledToken out;
  out.id = token;
  out.logprob = float(double(logits[token]) - lse);
  for (int32_t t : top_indices(logits, vocab, top))
    out.top.emplace_back(t, float(double(logits[t]) - lse));
  return out;
}

}  // namespace dsv4::cpu
