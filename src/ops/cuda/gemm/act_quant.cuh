// Device side of the FP8 activation quantisation (quantize_act_fp8, fp8_gemm.h), for the kernels
// that produce an activation and quantise it in the same pass (the RMSNorm of the q latent, the
// shared expert's SwiGLU): bytes identical to cpu::quantize_fp8 of the BF16 values they store.
// A half-warp quantises one 128-element block, 8 consecutive elements per lane.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace dsv4::cuda::act_quant {

// Exponent field of pow2_ceil(v) for a positive normal v (core/formats.h): the exponent, plus
// one when any mantissa bit is set. It is also the UE8M0 code of the scale.
__device__ __forceinline__ uint32_t pow2_ceil_exponent(float v) {
  const uint32_t b = __float_as_uint(v);
  return ((b >> 23) & 0xffu) + ((b & 0x7fffffu) != 0u ? 1u : 0u);
}

// One lane's 8 values of a 128-element block -> its 8 e4m3 codes (packed, element 0 in the low
// byte) and the block's scale exponent e (scale = 2^(e-127)). Every lane of the warp must call
// it (the half-warp shuffles use the full mask); lanes with no block pass zeros.
//   amax = max(max|x|, 1e-4); s = pow2_ceil(amax * (1/448)); q = e4m3_rne_sat(x / s).
__device__ __forceinline__ uint2 quantize_block8(const float (&v)[8], uint32_t& e) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) a = fmaxf(a, fabsf(v[i]));  // fmaxf ignores NaN, as std::max does
#pragma unroll
  for (int o = 8; o >= 1; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  // Dividing by s is multiplying by 1/s exactly.
  e = pow2_ceil_exponent(fmaxf(a, 1e-4f) * (1.0f / 448.0f));
  const float inv_s = __uint_as_float((254u - e) << 23);
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    // Saturating e4m3 conversion (RNE): |x/s| <= 448 by construction; NaN stays NaN (0x7f).
    const uint32_t c = __nv_cvt_float_to_fp8(v[i] * inv_s, __NV_SATFINITE, __NV_E4M3) & 0xffu;
    if (i < 4)
      lo |= c << (8 * i);
    else
      hi |= c << (8 * (i - 4));
  }
  return make_uint2(lo, hi);
}

// The block's fp32 scale at [kb, row] of the transposed scales (ld rows), by the lane that holds
// the block's first 8 elements; the last row also writes the pad rows [m, round_up(m, 4)) as 0
// (the tensor-core GEMM reads them, fp8_gemm.h).
__device__ __forceinline__ void store_block_scale(float* scales_t, int64_t ld, int kb, int64_t row,
                                                  int m, uint32_t e) {
  float* st = scales_t + int64_t(kb) * ld;
  st[row] = __uint_as_float(e << 23);
  if (row == m - 1)
    for (int r = m; r < (m + 3) / 4 * 4; ++r) st[r] = 0.0f;
}

}  // namespace dsv4::cuda::act_quant
