// Bit-exact number formats used by DeepSeek-V4 checkpoints and caches:
// BF16, FP8 e4m3 (the "fn" variant: no infinities, max 448), E8M0 power-of-two scales,
// and FP4 e2m1. All conversions from float round to nearest, ties to even.
#pragma once

#include <cstdint>
#include <cstring>

namespace dsv4 {

// ---- BF16 ----------------------------------------------------------------------------
using bf16_t = uint16_t;  // raw bits

inline float bf16_to_float(bf16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) {
    return static_cast<bf16_t>((u >> 16) | 0x0040u);  // quiet NaN, sign kept
  }
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<bf16_t>(u >> 16);
}

// Rounds a float to the nearest BF16 value and returns it as float.
inline float round_bf16(float f) {
  return bf16_to_float(float_to_bf16(f));
}

// ---- FP8 e4m3fn ------------------------------------------------------------------------
constexpr float kE4m3Max = 448.0f;

float e4m3_to_float(uint8_t code);
// Round to nearest even; |x| beyond 448 saturates to +-448; NaN -> 0x7f.
uint8_t float_to_e4m3(float x);

// ---- E8M0 (UE8M0) power-of-two scale ---------------------------------------------------
// value = 2^(code - 127); code 255 is NaN.
float e8m0_to_float(uint8_t code);
// `x` must be a positive power of two in [2^-127, 2^127].
uint8_t pow2_to_e8m0(float x);

// ---- FP4 e2m1 ----------------------------------------------------------------------------
// code: bit 3 sign, bits 0-2 magnitude index into {0, .5, 1, 1.5, 2, 3, 4, 6}.
constexpr float kE2m1Max = 6.0f;
float e2m1_to_float(uint8_t code);
// Round to nearest even; |x| beyond 6 saturates to +-6.
uint8_t float_to_e2m1(float x);

// Packed pairs: element 2k in the low nibble, 2k+1 in the high nibble.
inline uint8_t e2m1_low(uint8_t byte) {
  return byte & 0x0f;
}
inline uint8_t e2m1_high(uint8_t byte) {
  return byte >> 4;
}
inline uint8_t e2m1_pack(uint8_t lo, uint8_t hi) {
  return static_cast<uint8_t>((lo & 0x0f) | (hi << 4));
}

// ---- power-of-two scales --------------------------------------------------------------
// 2^ceil(log2(v)) for v > 0, computed from the IEEE bits of v exactly as the reference's
// fast_round_scale does (exponent, plus one if any mantissa bit is set).
float pow2_ceil(float v);

}  // namespace dsv4
