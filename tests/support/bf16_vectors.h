// BF16 data for the kernel tests and benchmarks: vectors of floats <-> BF16 bit patterns, and
// the BF16 spacing the tolerances are stated in.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/formats.h"

namespace dsv4::test {

inline std::vector<uint16_t> to_bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16(v[i]);
  return b;
}
inline std::vector<float> from_bf16_bits(const std::vector<uint16_t>& b) {
  std::vector<float> v(b.size());
  for (size_t i = 0; i < b.size(); ++i) v[i] = bf16_to_float(b[i]);
  return v;
}

// Distance between adjacent BF16 values at |v| (2^-133, the subnormal step, below 1e-30).
inline float bf16_ulp(float v) {
  v = std::fabs(v);
  if (v < 1e-30f) return std::ldexp(1.0f, -133);
  int e;
  std::frexp(v, &e);               // v = f * 2^e, f in [0.5, 1)
  return std::ldexp(1.0f, e - 8);  // v in [2^(e-1), 2^e): spacing 2^(e-1-7)
}

}  // namespace dsv4::test
