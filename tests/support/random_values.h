// Random test inputs of sane magnitude, from the project's Rng (a sequence fixed by the
// standard, core/rng.h) or from a std::mt19937 the test seeds.
#pragma once

#include <cstddef>
#include <random>
#include <vector>

#include "core/formats.h"
#include "core/rng.h"

namespace dsv4::test {

// n values N(0, sd^2) rounded to BF16, one rng.normal() each.
inline std::vector<float> random_bf16(Rng& rng, size_t n, float sd) {
  std::vector<float> x(n);
  for (auto& v : x) v = round_bf16(float(rng.normal()) * sd);
  return x;
}

// n values N(0, sd^2) from std::normal_distribution<float> on `rng`, rounded to BF16 unless
// round_to_bf16 is false.
inline std::vector<float> gaussian(size_t n, float sd, std::mt19937& rng,
                                   bool round_to_bf16 = true) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = round_to_bf16 ? round_bf16(d(rng)) : d(rng);
  return v;
}

}  // namespace dsv4::test
