// A seeded random source whose sequence is fixed by the C++ standard (mt19937_64) and our own
// transforms, so a seed gives the same numbers with every standard library.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>

namespace dsv4 {

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}

  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return double(gen_() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Standard normal (Box-Muller).
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    const double r = std::sqrt(-2.0 * std::log(u1)), t = 2.0 * std::numbers::pi * u2;
    spare_ = r * std::sin(t);
    has_spare_ = true;
    return r * std::cos(t);
  }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return gen_() % n; }

 private:
  std::mt19937_64 gen_;
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace dsv4
