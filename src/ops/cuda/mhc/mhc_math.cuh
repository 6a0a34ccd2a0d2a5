// Device arithmetic shared by the mHC kernels (mhc.cu, mhc_token.cu): the operations the CPU
// reference does in fp32, explicitly rounded (no FMA contraction), BF16 packing, and Sinkhorn in
// the CPU's order of operations (ops/cpu/mhc.cpp), so every kernel gets the CPU's bits for
// identical inputs.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace dsv4::cuda::mhc_math {

__device__ __forceinline__ float fmul(float a, float b) {
  return __fmul_rn(a, b);
}
__device__ __forceinline__ float fadd(float a, float b) {
  return __fadd_rn(a, b);
}
__device__ __forceinline__ float sigmoidf_ref(float x) {
  return __fdiv_rn(1.0f, fadd(1.0f, expf(-x)));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = __bfloat162float(b[i]);
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  v.x = pack_bf16(f[0], f[1]);
  v.y = pack_bf16(f[2], f[3]);
  v.z = pack_bf16(f[4], f[5]);
  v.w = pack_bf16(f[6], f[7]);
  return v;
}

// f == hi + mid + lo exactly (for normal f): each residual is exact by Sterbenz' lemma, and the
// last has at most 8 significant bits. With BF16 activations, every product of a part is exact in
// the tensor core, so a projection over the three parts differs from fp32 x fp32 only in the
// accumulation.
__device__ __forceinline__ void split3(float f, float& hi, float& mid, float& lo) {
  hi = __bfloat162float(__float2bfloat16_rn(f));
  const float r1 = f - hi;
  mid = __bfloat162float(__float2bfloat16_rn(r1));
  lo = r1 - mid;  // <= 8 significant bits: exact in BF16
}

// The MMA B fragments (hi, mid, lo parts, four BF16 pairs each) of one n-tile's 8 fp32 fn
// values.
__device__ __forceinline__ void split3_fragments(const float (&f)[8], uint32_t (&frag)[3][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float h0, m0, l0, h1, m1, l1;
    split3(f[2 * q], h0, m0, l0);
    split3(f[2 * q + 1], h1, m1, l1);
    frag[0][q] = pack_bf16(h0, h1);
    frag[1][q] = pack_bf16(m0, m1);
    frag[2][q] = pack_bf16(l0, l1);
  }
}

// Sinkhorn of one token's 4x4 matrix, exactly the CPU's order of operations (ops/cpu/mhc.cpp).
__device__ __forceinline__ void sinkhorn4(float (&c)[16], int iters, float eps) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float mx = c[j * 4];
#pragma unroll
    for (int k = 1; k < 4; ++k) mx = fmaxf(mx, c[j * 4 + k]);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      c[j * 4 + k] = expf(c[j * 4 + k] - mx);
      sum = fadd(sum, c[j * 4 + k]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) c[j * 4 + k] = fadd(__fdiv_rn(c[j * 4 + k], sum), eps);
  }
  auto col_norm = [&] {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) s = fadd(s, c[j * 4 + k]);
      const float d = fadd(s, eps);
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j * 4 + k] = __fdiv_rn(c[j * 4 + k], d);
    }
  };
  auto row_norm = [&] {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float s = 0.0f;
#pragma unroll
      for (int k = 0; k < 4; ++k) s = fadd(s, c[j * 4 + k]);
      const float d = fadd(s, eps);
#pragma unroll
      for (int k = 0; k < 4; ++k) c[j * 4 + k] = __fdiv_rn(c[j * 4 + k], d);
    }
  };
  col_norm();
  for (int it = 1; it < iters; ++it) {
    row_norm();
    col_norm();
  }
}

// sinkhorn4 on 16 lanes of a half-warp: lane 4j + k (of lanes & 15) holds c[j][k] and gets the
// result. Each row / column sum is gathered by shuffles and added in index order, exactly as
// sinkhorn4 adds, so the result is bit-identical. The sums start from their first term rather
// than from 0 + it (one dependent addition less per normalisation on this latency-bound chain):
// 0 + x == x for every x but -0, and no term here is -0 (exp results and their quotients by
// positive sums are >= +0, NaN stays NaN). Every lane of the warp must call it.
__device__ __forceinline__ float sinkhorn4_lanes(float c, int iters, float eps) {
  const int lane = threadIdx.x & 31, base = lane & 16, j = (lane & 15) >> 2, k = lane & 3;
  auto row_at = [&](float v, int kk) { return __shfl_sync(0xffffffffu, v, base + j * 4 + kk); };
  auto col_at = [&](float v, int jj) { return __shfl_sync(0xffffffffu, v, base + jj * 4 + k); };
  float mx = row_at(c, 0);
#pragma unroll
  for (int kk = 1; kk < 4; ++kk) mx = fmaxf(mx, row_at(c, kk));
  c = expf(c - mx);
  float sum = row_at(c, 0);
#pragma unroll
  for (int kk = 1; kk < 4; ++kk) sum = fadd(sum, row_at(c, kk));
  c = fadd(__fdiv_rn(c, sum), eps);
  auto col_norm = [&] {
    float s = col_at(c, 0);
#pragma unroll
    for (int jj = 1; jj < 4; ++jj) s = fadd(s, col_at(c, jj));
    c = __fdiv_rn(c, fadd(s, eps));
  };
  auto row_norm = [&] {
    float s = row_at(c, 0);
#pragma unroll
    for (int kk = 1; kk < 4; ++kk) s = fadd(s, row_at(c, kk));
    c = __fdiv_rn(c, fadd(s, eps));
  };
  col_norm();
  for (int it = 1; it < iters; ++it) {
    row_norm();
    col_norm();
  }
  return c;
}
}  // namespace dsv4::cuda::mhc_math
