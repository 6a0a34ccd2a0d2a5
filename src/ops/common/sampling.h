// How the next token is chosen from a row of logits, shared by the CPU sampler (the
// reference, ops/cpu/sampler.h) and the GPU one, so a seeded request picks the same tokens on
// both backends wherever their logits agree.
//
// Order, on fp32 logits z of one row:
//  1. logprobs (when asked): log-softmax of the raw z (before bias, penalties, temperature);
//  2. logit_bias: z[t] += bias;
//  3. penalties over the request's history: repetition (every token of prompt or output:
//     z > 0 ? z / r : z * r), then frequency and presence (output tokens: z -= f * count,
//     z -= p), as vLLM applies them;
//  4. temperature 0: the first index of the largest z (greedy); else probabilities
//     p = softmax(z / T) and, in this order, min_p (drop p < min_p * max p), top_k (keep the
//     k largest, ties with the k-th kept), top_p (keep the smallest set of largest p whose
//     sum reaches top_p times the kept mass, ties with its last kept);
//  5. the draw: the kept token with the largest p / E, E = -ln(u), u = sample_uniform(seed,
//     i, token) for output token i of the request: an exponential race, which picks token t
//     with probability p_t / sum(p). It depends on the seed, i and the row alone, so batching,
//     preemption and the backend do not change it.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/error.h"

#if defined(__CUDACC__)
#define DSV4_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define DSV4_SAMPLING_HD inline
#endif

namespace dsv4 {

constexpr int kMaxTopLogprobs = 20;

struct SamplingParams {
  float temperature = 0;  // 0: greedy
  int top_k = 0;          // 0: every token
  float top_p = 1;        // 1: off
  float min_p = 0;        // 0: off
  float presence_penalty = 0;
  float frequency_penalty = 0;
  float repetition_penalty = 1;
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token, bias)
  uint64_t seed = 0;
  bool logprobs = false;  // report the chosen token's logprob
  int top_logprobs = 0;   // and this many most likely alternatives (<= kMaxTopLogprobs)

  bool penalised() const {
    return presence_penalty != 0 || frequency_penalty != 0 || repetition_penalty != 1;
  }
};

// A request's token history for the penalties: distinct output tokens with their counts, and
// the distinct prompt tokens (repetition penalty only).
struct TokenCounts {
  std::vector<std::pair<int32_t, int32_t>> output;  // (token, count), any order
  std::vector<int32_t> prompt;                      // distinct
};

DSV4_SAMPLING_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The uniform in (0, 1) of `token` for output token `index` of a request seeded `seed`.
DSV4_SAMPLING_HD double sample_uniform(uint64_t seed, int64_t index, int32_t token) {
  const uint64_t h = splitmix64(splitmix64(seed ^ splitmix64(uint64_t(index))) ^
                                (uint64_t(uint32_t(token)) * 0xD1B54A32D192ED03ull));
  return (double(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);  // 2^-53
}

// Throws dsv4::Error naming the first parameter a sampler cannot take: both backends check a
// step's sampling requests with it before running anything.
inline void check_sampling_request(const SamplingParams* params, const TokenCounts* counts,
                                   int32_t forced, int vocab) {
  DSV4_CHECK(params != nullptr, "sample without sampling parameters");
  const SamplingParams& p = *params;
  DSV4_CHECK(std::isfinite(p.temperature) && p.temperature >= 0, "temperature must be >= 0");
  DSV4_CHECK(p.top_k >= 0, "top_k must be >= 0");
  DSV4_CHECK(p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1]");
  DSV4_CHECK(p.min_p >= 0 && p.min_p <= 1, "min_p must be in [0, 1]");
  DSV4_CHECK(std::isfinite(p.presence_penalty) && std::isfinite(p.frequency_penalty) &&
                 std::isfinite(p.repetition_penalty) && p.repetition_penalty > 0,
             "penalties must be finite (repetition > 0)");
  DSV4_CHECK(p.top_logprobs >= 0 && p.top_logprobs <= kMaxTopLogprobs,
             "top_logprobs must be in [0, ", kMaxTopLogprobs, "]");
  for (const auto& [t, b] : p.logit_bias)
    DSV4_CHECK(t >= 0 && t < vocab && std::isfinite(b), "logit_bias token ", t,
               " out of range [0, ", vocab, ") or not finite");
  DSV4_CHECK(forced < vocab, "forced token ", forced, " out of range");
  if (counts) {
    for (const auto& [t, c] : counts->output)
      DSV4_CHECK(t >= 0 && t < vocab && c >= 0, "token count of ", t, " out of range");
    for (int32_t t : counts->prompt) DSV4_CHECK(t >= 0 && t < vocab, "token ", t, " out of range");
  }
}

// What the sampler returns for one row.
struct SampledToken {
  int32_t id = -1;
  float logprob = 0;                           // of `id`, when logprobs were asked
  std::vector<std::pair<int32_t, float>> top;  // top_logprobs alternatives, most likely first
};

}  // namespace dsv4
