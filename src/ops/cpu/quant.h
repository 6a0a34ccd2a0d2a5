// Block quantisation with power-of-two (UE8M0) scales, exactly as the reference's act_quant
// (FP8 e4m3) and fp4_act_quant (FP4 e2m1) kernels: per block of `block` elements,
// amax = max(max|x|, floor), s = 2^ceil(log2(amax / qmax)), q = round(clamp(x / s)).
// Inputs are floats holding BF16 values; dequantised outputs q*s are exact in BF16.
#pragma once

#include <cstdint>

namespace dsv4::cpu {

constexpr float kFp8AmaxFloor = 1e-4f;
// 6 * 2^-126, the reference's floor for FP4 block amax.
constexpr float kFp4AmaxFloor = 6.0f * 1.1754943508222875e-38f;

// Scale of one FP8 block: 2^ceil(log2(max(amax, 1e-4) / 448)).
float fp8_block_scale(const float* x, int n);
// Scale of one FP4 block: 2^ceil(log2(max(amax, 6*2^-126) / 6)).
float fp4_block_scale(const float* x, int n);

// e4m3 codes and E8M0 scale bytes for `n` elements in blocks of `block` (n % block == 0).
void quantize_fp8(const float* x, int n, int block, uint8_t* codes, uint8_t* scales);
// e2m1 codes packed two per byte (element 2k low nibble) and E8M0 scales.
void quantize_fp4(const float* x, int n, int block, uint8_t* packed, uint8_t* scales);

// Quantise and dequantise in one pass (the reference's fake-quant); in place is allowed.
void fake_quant_fp8(const float* x, int n, int block, float* out);
void fake_quant_fp4(const float* x, int n, int block, float* out);

}  // namespace dsv4::cpu
