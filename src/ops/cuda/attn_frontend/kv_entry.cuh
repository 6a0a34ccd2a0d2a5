// One 512-wide KV row per warp (lane l holds elements [8l, 8l+8) in x0 and [256+8l, 256+8l+8)
// in x1): kv_norm + RoPE, and the 584-byte FP8 entry of cpu::encode_kv_entry.
#pragma once

#include <cstdint>

#include "ops/cuda/common/numerics.cuh"

namespace dsv4::cuda {

constexpr int kKvDataBytes = 576;  // 448 e4m3 + 64 BF16
constexpr int kKvScaleBytes = 8;   // 7 UE8M0 + 1 zero pad
constexpr int kKvEntryBytes = kKvDataBytes + kKvScaleBytes;

// cpu::rms_norm (fp32 math, mean of squares summed in double) then cpu::rope_apply of the
// last 64 dims (lanes 24..31 of x1, pairs 4(l-24)..4(l-24)+3, angles cs).
__device__ __forceinline__ void kv_norm_rope_row(float* x0, float* x1, const float* w0,
                                                 const float* w1, const float2* cs, float eps,
                                                 int lane) {
  double ss = 0.0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    ss = __dadd_rn(ss, __dmul_rn(double(x0[i]), double(x0[i])));
    ss = __dadd_rn(ss, __dmul_rn(double(x1[i]), double(x1[i])));
  }
  ss = num::warp_sum_d(ss);
  const float ms = float(__ddiv_rn(ss, 512.0));
  const float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x0[i] = num::bf16r(__fmul_rn(w0[i], __fmul_rn(x0[i], rs)));
    x1[i] = num::bf16r(__fmul_rn(w1[i], __fmul_rn(x1[i], rs)));
  }
  if (lane >= 24) {
#pragma unroll
    for (int j = 0; j < 4; ++j) num::rope_pair(x1[2 * j], x1[2 * j + 1], cs[j], false);
  }
}

// A lane's share of the entry: 8 codes of x0; 8 codes of x1 (lanes < 24) or 8 BF16 RoPE values
// (lanes >= 24); the 8 scale bytes (all lanes).
struct KvEntryRegs {
  uint2 codes0;
  uint4 part1;
  uint32_t scales_lo, scales_hi;
  float s0, s1;
};

__device__ __forceinline__ KvEntryRegs encode_kv_row(const float* x0, const float* x1, int lane) {
  float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    a0 = fmaxf(a0, fabsf(x0[i]));
    a1 = fmaxf(a1, fabsf(x1[i]));
  }
  // A 64-element block is an aligned group of 8 lanes.
  a0 = num::warp_max_f<8>(a0);
  a1 = num::warp_max_f<8>(a1);
  KvEntryRegs e;
  e.s0 = num::fp8_scale_from_amax(a0);
  e.s1 = num::fp8_scale_from_amax(a1);
  e.codes0 = num::e4m3x8(x0, e.s0);
  if (lane < 24) {
    const uint2 c = num::e4m3x8(x1, e.s1);
    e.part1 = make_uint4(c.x, c.y, 0u, 0u);
  } else {
    e.part1 = num::pack8(x1);
  }
  const uint32_t b0 = num::pow2_to_e8m0(e.s0), b1 = num::pow2_to_e8m0(e.s1);
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) lo |= __shfl_sync(0xffffffffu, b0, 8 * q) << (8 * q);
#pragma unroll
  for (int q = 0; q < 3; ++q) hi |= __shfl_sync(0xffffffffu, b1, 8 * q) << (8 * q);
  e.scales_lo = lo;
  e.scales_hi = hi;  // byte 7 (pad) stays 0
  return e;
}

// Into a cache page: data 16-byte aligned (576-byte slots), scales 8-byte aligned.
__device__ __forceinline__ void store_kv_entry(const KvEntryRegs& e, uint8_t* data, uint8_t* scales,
                                               int lane) {
  *reinterpret_cast<uint2*>(data + 8 * lane) = e.codes0;
  if (lane < 24)
    *reinterpret_cast<uint2*>(data + 256 + 8 * lane) = make_uint2(e.part1.x, e.part1.y);
  else
    *reinterpret_cast<uint4*>(data + 448 + 16 * (lane - 24)) = e.part1;
  if (lane == 0) *reinterpret_cast<uint2*>(scales) = make_uint2(e.scales_lo, e.scales_hi);
}

// Into a packed 584-byte entry (data then scales), 8-byte aligned.
__device__ __forceinline__ void store_kv_entry_packed(const KvEntryRegs& e, uint8_t* d, int lane) {
  *reinterpret_cast<uint2*>(d + 8 * lane) = e.codes0;
  if (lane < 24) {
    *reinterpret_cast<uint2*>(d + 256 + 8 * lane) = make_uint2(e.part1.x, e.part1.y);
  } else {
    *reinterpret_cast<uint2*>(d + 448 + 16 * (lane - 24)) = make_uint2(e.part1.x, e.part1.y);
    *reinterpret_cast<uint2*>(d + 456 + 16 * (lane - 24)) = make_uint2(e.part1.z, e.part1.w);
  }
  if (lane == 0) *reinterpret_cast<uint2*>(d + kKvDataBytes) = make_uint2(e.scales_lo, e.scales_hi);
}

// The entry as cpu::decode_kv_entry returns it (code * scale, exact in BF16; RoPE as stored).
__device__ __forceinline__ void decode_kv_row(const KvEntryRegs& e, const float* x1, float* y0,
                                              float* y1, int lane) {
  const uint32_t c0[2] = {e.codes0.x, e.codes0.y};
  const uint32_t c1[2] = {e.part1.x, e.part1.y};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    y0[i] = __fmul_rn(num::e4m3_to_float(uint8_t(c0[i / 4] >> (8 * (i % 4)))), e.s0);
    y1[i] = lane < 24 ? __fmul_rn(num::e4m3_to_float(uint8_t(c1[i / 4] >> (8 * (i % 4)))), e.s1)
                      : x1[i];
  }
}

}  // namespace dsv4::cuda
