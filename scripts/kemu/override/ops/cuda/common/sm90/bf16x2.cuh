#pragma once
#include <cstdint>
namespace dsv4::cuda::sm90 {
inline uint16_t kemu_bf16_rn(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
inline uint32_t pack_bf16x2(float lo, float hi) {
  return uint32_t(kemu_bf16_rn(lo)) | (uint32_t(kemu_bf16_rn(hi)) << 16);
}
inline float kemu_lo(uint32_t v) {
  return __uint_as_float(v << 16);
}
inline float kemu_hi(uint32_t v) {
  return __uint_as_float(v & 0xffff0000u);
}
inline uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  return pack_bf16x2(kemu_lo(a) * kemu_lo(b), kemu_hi(a) * kemu_hi(b));
}
inline uint32_t max_bf16x2(uint32_t a, uint32_t b) {
  auto mx = [](float x, float y) {
    return std::isnan(x) ? y : (std::isnan(y) ? x : (x > y ? x : y));
  };
  return pack_bf16x2(mx(kemu_lo(a), kemu_lo(b)), mx(kemu_hi(a), kemu_hi(b)));
}
inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}
inline float bf16lo_to_float(uint32_t v) {
  return __uint_as_float(v << 16);
}
inline float bf16hi_to_float(uint32_t v) {
  return __uint_as_float(v & 0xffff0000u);
}
inline float bf16_bits_to_float(uint16_t v) {
  return __uint_as_float(uint32_t(v) << 16);
}
inline uint16_t float_to_bf16_bits(float f) {
  return static_cast<uint16_t>(pack_bf16x2(f, 0.0f) & 0xffffu);
}
}  // namespace dsv4::cuda::sm90
