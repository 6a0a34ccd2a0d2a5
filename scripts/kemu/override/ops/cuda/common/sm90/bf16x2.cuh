#pragma once
#include <cmath>
#include <cstdint>

#include "ops/cuda/common/numerics.cuh"
namespace dsv4::cuda::sm90 {
inline float bf16lo_to_float(uint32_t v) {
  return num::bf16_lo(v);
}
inline float bf16hi_to_float(uint32_t v) {
  return num::bf16_hi(v);
}
inline float bf16_bits_to_float(uint16_t v) {
  return num::bf16_lo(v);
}
inline uint32_t pack_bf16x2(float lo, float hi) {
  return uint32_t(num::bf16_bits(lo)) | (uint32_t(num::bf16_bits(hi)) << 16);
}
inline uint16_t float_to_bf16_bits(float f) {
  return num::bf16_bits(f);
}
inline uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  return pack_bf16x2(num::bf16_lo(a) * num::bf16_lo(b), num::bf16_hi(a) * num::bf16_hi(b));
}
inline uint32_t max_bf16x2(uint32_t a, uint32_t b) {
  auto mx = [](float x, float y) {
    return std::isnan(x) ? y : (std::isnan(y) ? x : (x > y ? x : y));
  };
  return pack_bf16x2(mx(num::bf16_lo(a), num::bf16_lo(b)), mx(num::bf16_hi(a), num::bf16_hi(b)));
}
inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}
}  // namespace dsv4::cuda::sm90
