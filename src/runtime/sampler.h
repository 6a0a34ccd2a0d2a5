// Token choice from fp32 logits: greedy (argmax, first index on ties) or temperature
// sampling by the Gumbel-max/exponential race the reference's generate.py uses, from a
// seeded generator so a seed reproduces a run.
#pragma once

#include <cstdint>
#include <random>

namespace dsv4 {

class Sampler {
 public:
  Sampler(float temperature, uint64_t seed);
  int32_t sample(const float* logits, int vocab);

 private:
  float temperature_;
  std::mt19937_64 rng_;
};

int32_t argmax(const float* logits, int vocab);

}  // namespace dsv4
