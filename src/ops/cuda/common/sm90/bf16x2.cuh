// Packed BF16 arithmetic in single PTX instructions (cvt/mul/max on bf16x2), the byte permute
// that the exact cache decoders build BF16 values with, and BF16 bit <-> float conversions.
#pragma once

#include <cstdint>

namespace dsv4::cuda::sm90 {

// Two floats -> BF16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// Correctly rounded BF16x2 product (the reference's bf16(a * b) for BF16 a, b).
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t max_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// Byte permute: byte i of the result is byte (sel >> 4i) & 7 of the eight bytes of {b, a}
// (a holds bytes 0-3).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// BF16 halves of a packed word, and single BF16 bit patterns, as floats (exact).
__device__ __forceinline__ float bf16lo_to_float(uint32_t v) {
  return __uint_as_float(v << 16);
}
__device__ __forceinline__ float bf16hi_to_float(uint32_t v) {
  return __uint_as_float(v & 0xffff0000u);
}
__device__ __forceinline__ float bf16_bits_to_float(uint16_t v) {
  return __uint_as_float(uint32_t(v) << 16);
}
__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) {
  return static_cast<uint16_t>(pack_bf16x2(f, 0.0f) & 0xffffu);
}

}  // namespace dsv4::cuda::sm90
