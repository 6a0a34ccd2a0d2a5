#include "ops/cpu/quant.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/formats.h"

namespace dsv4::cpu {
namespace {

float block_amax(const float* x, int n) {
  float a = 0.0f;
  for (int i = 0; i < n; ++i) a = std::max(a, std::fabs(x[i]));
  return a;
}

}  // namespace

float fp8_block_scale(const float* x, int n) {
  // The reference multiplies by the float reciprocal of the format maximum.
  return pow2_ceil(std::max(block_amax(x, n), kFp8AmaxFloor) * (1.0f / kE4m3Max));
}

float fp4_block_scale(const float* x, int n) {
  return pow2_ceil(std::max(block_amax(x, n), kFp4AmaxFloor) * (1.0f / kE2m1Max));
}

void quantize_fp8(const float* x, int n, int block, uint8_t* codes, uint8_t* scales) {
  DSV4_CHECK(block > 0 && n % block == 0, "quantize_fp8: ", n, " not a multiple of ", block);
  for (int b = 0; b < n / block; ++b) {
    const float* xb = x + b * block;
    const float s = fp8_block_scale(xb, block);
    scales[b] = pow2_to_e8m0(s);
    for (int i = 0; i < block; ++i)
      codes[b * block + i] = float_to_e4m3(std::clamp(xb[i] / s, -kE4m3Max, kE4m3Max));
  }
}

void quantize_fp4(const float* x, int n, int block, uint8_t* packed, uint8_t* scales) {
  DSV4_CHECK(block > 0 && block % 2 == 0 && n % block == 0, "quantize_fp4: ", n,
             " not a multiple of ", block);
  for (int b = 0; b < n / block; ++b) {
    const float* xb = x + b * block;
    const float s = fp4_block_scale(xb, block);
    scales[b] = pow2_to_e8m0(s);
    for (int i = 0; i < block; i += 2) {
      uint8_t lo = float_to_e2m1(std::clamp(xb[i] / s, -kE2m1Max, kE2m1Max));
      uint8_t hi = float_to_e2m1(std::clamp(xb[i + 1] / s, -kE2m1Max, kE2m1Max));
      packed[(b * block + i) / 2] = e2m1_pack(lo, hi);
    }
  }
}

void fake_quant_fp8(const float* x, int n, int block, float* out) {
  DSV4_CHECK(block > 0 && n % block == 0, "fake_quant_fp8: ", n, " not a multiple of ", block);
  for (int b = 0; b < n / block; ++b) {
    const float s = fp8_block_scale(x + b * block, block);
    for (int i = b * block; i < (b + 1) * block; ++i)
      out[i] = e4m3_to_float(float_to_e4m3(std::clamp(x[i] / s, -kE4m3Max, kE4m3Max))) * s;
  }
}

void fake_quant_fp4(const float* x, int n, int block, float* out) {
  DSV4_CHECK(block > 0 && n % block == 0, "fake_quant_fp4: ", n, " not a multiple of ", block);
  for (int b = 0; b < n / block; ++b) {
    const float s = fp4_block_scale(x + b * block, block);
    for (int i = b * block; i < (b + 1) * block; ++i)
      out[i] = e2m1_to_float(float_to_e2m1(std::clamp(x[i] / s, -kE2m1Max, kE2m1Max))) * s;
  }
}

}  // namespace dsv4::cpu
