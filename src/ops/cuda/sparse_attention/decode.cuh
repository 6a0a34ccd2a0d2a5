// Exact decoders of the cache formats into BF16 (cpu::decode_kv_entry / decode_index_key bit
// for bit), built only on the packed-BF16 primitives of common/sm90/bf16x2.cuh, and batch
// indexing helpers.
#pragma once

#include <cstdint>

#include "ops/cuda/common/sm90/bf16x2.cuh"

namespace dsv4::cuda::detail {

// 2^(code - 127) as a float for an E8M0 code (code 0 is 2^-127, a subnormal).
__device__ __forceinline__ float e8m0_to_float(uint32_t code) {
  return code == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(code << 23);
}
// BF16x2 holding 2^e twice, for -133 <= e <= 127 (exact powers of two; 0 below).
__device__ __forceinline__ uint32_t bf16x2_pow2(int e) {
  uint32_t b;
  if (e >= -126)
    b = uint32_t(e + 127) << 7;
  else if (e >= -133)
    b = 1u << (e + 133);  // subnormal BF16
  else
    b = 0;
  return b | (b << 16);
}

// ---- cache decoders ------------------------------------------------------------------------
// Eight packed e2m1 codes (element 2k in the low nibble of byte k) -> four BF16x2 words
// holding the exact e2m1 values (pair k = elements 2k, 2k+1), each multiplied by `scale2`
// (a BF16x2 power of two; the product is exact).
__device__ __forceinline__ void e2m1x8_to_bf16x8(uint32_t w, uint32_t scale2, uint32_t (&out)[4]) {
  // BF16 bits of the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, split in low and high bytes and
  // looked up with byte permutes (selector nibbles = 3-bit magnitude codes).
  constexpr uint32_t kLoA = 0xC0800000u, kLoB = 0xC0804000u;
  constexpr uint32_t kHiA = 0x3F3F3F00u, kHiB = 0x40404040u;
  const uint32_t m = w & 0x77777777u;
  const uint32_t mh = m >> 16;
  const uint32_t lo0 = sm90::prmt(kLoA, kLoB, m), hi0 = sm90::prmt(kHiA, kHiB, m);
  const uint32_t lo1 = sm90::prmt(kLoA, kLoB, mh), hi1 = sm90::prmt(kHiA, kHiB, mh);
  uint32_t p[4];
  p[0] = sm90::prmt(lo0, hi0, 0x5140u);
  p[1] = sm90::prmt(lo0, hi0, 0x7362u);
  p[2] = sm90::prmt(lo1, hi1, 0x5140u);
  p[3] = sm90::prmt(lo1, hi1, 0x7362u);
  // Sign of element 2k+0 is bit 8k+3 of w, of element 2k+1 bit 8k+7: gather them to bits 15/31.
  const uint32_t y = w << 4;
  const uint32_t s0 = sm90::prmt(w, y, 0x0044u), s1 = sm90::prmt(w, y, 0x1155u);
  const uint32_t s2 = sm90::prmt(w, y, 0x2266u), s3 = sm90::prmt(w, y, 0x3377u);
  out[0] = sm90::mul_bf16x2(p[0] | (s0 & 0x80008000u), scale2);
  out[1] = sm90::mul_bf16x2(p[1] | (s1 & 0x80008000u), scale2);
  out[2] = sm90::mul_bf16x2(p[2] | (s2 & 0x80008000u), scale2);
  out[3] = sm90::mul_bf16x2(p[3] | (s3 & 0x80008000u), scale2);
}

// Four e4m3 codes (bytes b0..b3 of w) -> two BF16x2 words {b0, b1} and {b2, b3} holding
// e4m3(b) * 2^(ex) exactly, where `scale2` = BF16x2 of 2^(ex + 120) (the e4m3 bits are placed
// into the BF16 exponent/mantissa fields, which divides by 2^120; subnormal codes land on BF16
// subnormals and come out exact as well).
__device__ __forceinline__ void e4m3x4_to_bf16x4(uint32_t w, uint32_t scale2, uint32_t& p01,
                                                 uint32_t& p23) {
  // Byte b -> 16-bit lane (b << 8): sign at bit 15, eeeemmm at bits 14..8; >> 4 moves
  // eeeemmm to bits 10..4 (the BF16 exponent's low 4 bits and the mantissa's top 3).
  const uint32_t a = sm90::prmt(w, 0u, 0x1404u);  // lanes {b0 << 8, b1 << 8}
  const uint32_t b = sm90::prmt(w, 0u, 0x3424u);  // lanes {b2 << 8, b3 << 8}
  const uint32_t ba = ((a & 0x7f007f00u) >> 4) | (a & 0x80008000u);
  const uint32_t bb = ((b & 0x7f007f00u) >> 4) | (b & 0x80008000u);
  p01 = sm90::mul_bf16x2(ba, scale2);
  p23 = sm90::mul_bf16x2(bb, scale2);
}

// ---- misc ----------------------------------------------------------------------------------
// Sequence of token t: the s with cu[s] <= t < cu[s+1] (cu ascending, cu[0] = 0).
__device__ __forceinline__ int seq_of_token(const int32_t* cu, int num_seqs, int t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(cu + mid) <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace dsv4::cuda::detail
