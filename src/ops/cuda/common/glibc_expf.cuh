// expf exactly as the CPU reference gets it from glibc, for the compressor's softmax. Apart
// from numerics.cuh because of its table: a __device__ array is kept in every module whose
// translation unit sees it, used or not.
#pragma once

#include <cstdint>

namespace dsv4::cuda::num {

// 2^(k/32) with k << 47 subtracted (glibc __exp2f_data.tab).
__device__ const uint64_t kExp2fTab[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull};

// expf as the CPU reference gets it from glibc (>= 2.28, sysdeps/ieee754/flt-32/e_expf.c, as
// the x86-64 FMA build compiles it: both uses of InvLn2N*x fused, the cubic in FMAs): a
// 32-entry 2^(k/32) table and a cubic in double. The compressor's softmax then rounds exactly
// as the CPU's std::exp(float) does: this sequence of operations, run on the host, matched
// glibc 2.36's expf on all 2.24e9 floats in [-104, 89] (0 mismatches; CUDA's expf is only
// within 2 ulp, and a non-FMA build of the same code differs on 2 inputs).
__device__ __forceinline__ float glibc_expf(float x) {
  const uint32_t ux = __float_as_uint(x);
  const uint32_t abstop = (ux >> 20) & 0x7ff;
  if (abstop >= 0x42b) {  // |x| >= 88 or NaN
    if (ux == 0xff800000u) return 0.0f;
    if (abstop >= 0x7f8) return x + x;
    if (x > 0x1.62e42ep6f) return __uint_as_float(0x7f800000u);
    if (x < -0x1.9fe368p6f) return 0.0f;
  }
  constexpr double kN = 32.0;
  constexpr double kInvLn2N = 0x1.71547652b82fep+0 * kN;
  constexpr double kC0 = 0x1.c6af84b912394p-5 / kN / kN / kN;
  constexpr double kC1 = 0x1.ebfce50fac4f3p-3 / kN / kN;
  constexpr double kC2 = 0x1.62e42ff0c52d6p-1 / kN;
  constexpr double kShift = 0x1.8p+52;
  const double xd = double(x);
  // GCC fuses both uses of InvLn2N * x into FMAs, and the polynomial's multiply-adds.
  double kd = __fma_rn(kInvLn2N, xd, kShift);
  const uint64_t ki = uint64_t(__double_as_longlong(kd));
  kd = __dsub_rn(kd, kShift);
  const double r = __fma_rn(kInvLn2N, xd, -kd);
  uint64_t t = kExp2fTab[ki % 32];
  t += ki << (52 - 5);
  const double s = __longlong_as_double((long long)t);
  const double r2 = __dmul_rn(r, r);
  const double zz = __fma_rn(kC0, r, kC1);
  double y = __fma_rn(kC2, r, 1.0);
  y = __fma_rn(zz, r2, y);
  return float(__dmul_rn(y, s));
}

}  // namespace dsv4::cuda::num
