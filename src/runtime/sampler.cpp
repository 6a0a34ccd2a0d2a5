#include "runtime/sampler.h"

#include <cmath>
#include <vector>

#include "core/error.h"

namespace dsv4 {

int32_t argmax(const float* x, int vocab) {
  int32_t best = 0;
  for (int i = 1; i < vocab; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

Sampler::Sampler(float temperature, uint64_t seed) : temperature_(temperature), rng_(seed) {
  DSV4_CHECK(temperature >= 0 && std::isfinite(temperature), "temperature must be >= 0, got ",
             temperature);
}

int32_t Sampler::sample(const float* logits, int vocab) {
  if (temperature_ == 0) return argmax(logits, vocab);
  // probs = softmax(logits / T); pick argmax(probs / E), E ~ Exp(1).
  float mx = logits[0] / temperature_;
  for (int i = 1; i < vocab; ++i) mx = std::fmax(mx, logits[i] / temperature_);
  std::exponential_distribution<double> exp1(1.0);
  int32_t best = 0;
  double best_v = -1;
  for (int i = 0; i < vocab; ++i) {
    const double p = std::exp(double(logits[i] / temperature_) - mx);
    const double v = p / exp1(rng_);
    if (v > best_v) best_v = v, best = i;
  }
  return best;
}

}  // namespace dsv4
