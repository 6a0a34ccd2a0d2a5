// Device numerics shared by the attention front end, the compressors, the output path and the
// MoE kernels: the exact rounding points of the CPU reference (core/formats.h, ops/cpu/quant.h,
// norm.h, rope.h, hadamard.h, compressor.cpp). Every fp32/fp64 operation that must match the CPU
// bit for bit is written with an explicitly rounded intrinsic (__fmul_rn, __fadd_rn, ...): nvcc
// contracts a*b+c into an FMA by default, the CPU reference is built with -ffp-contract=off.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace dsv4::cuda::num {

constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;
constexpr float kFp8AmaxFloor = 1e-4f;                           // cpu::kFp8AmaxFloor
constexpr float kFp4AmaxFloor = 6.0f * 1.1754943508222875e-38f;  // cpu::kFp4AmaxFloor

// ---- BF16 ----------------------------------------------------------------------------------
__device__ __forceinline__ float bf16r(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ uint16_t bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float bf16_lo(uint32_t w) {
  return __uint_as_float(w << 16);
}
__device__ __forceinline__ float bf16_hi(uint32_t w) {
  return __uint_as_float(w & 0xffff0000u);
}
// Two floats that hold BF16 values -> packed bits (exact).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
}
// 8 BF16 values of a uint4 -> floats, and back (the floats must hold BF16 values).
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = bf16_lo(w[i]);
    f[2 * i + 1] = bf16_hi(w[i]);
  }
}
__device__ __forceinline__ uint4 pack8(const float* f) {
  return make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]),
                    pack_bf16(f[6], f[7]));
}

// ---- power-of-two scales ---------------------------------------------------------------------
// 2^ceil(log2(v)) from the IEEE bits, as dsv4::pow2_ceil (v positive and normal).
__device__ __forceinline__ float pow2_ceil(float v) {
  const uint32_t b = __float_as_uint(v);
  const int e = int((b >> 23) & 0xff) - 127 + ((b & 0x7fffffu) ? 1 : 0);
  return __uint_as_float(uint32_t(e + 127) << 23);
}
// E8M0 code of a power of two p, as dsv4::pow2_to_e8m0 (clamped to [0, 254]).
__device__ __forceinline__ uint8_t pow2_to_e8m0(float p) {
  const int code = int((__float_as_uint(p) >> 23) & 0xff);
  return uint8_t(code > 254 ? 254 : code);
}
__device__ __forceinline__ float e8m0_to_float(uint8_t code) {
  if (code == 0) return 5.877471754111438e-39f;           // 2^-127, subnormal
  if (code == 0xff) return __uint_as_float(0x7fc00000u);  // NaN
  return __uint_as_float(uint32_t(code) << 23);
}

// std::clamp(v, -m, m) including its NaN behaviour (NaN passes through).
__device__ __forceinline__ float clamp_sym(float v, float m) {
  return v < -m ? -m : (m < v ? m : v);
}

// ---- FP8 e4m3 ----------------------------------------------------------------------------------
// Scale of one FP8 block from its amax: 2^ceil(log2(max(amax, 1e-4) * (1/448))).
__device__ __forceinline__ float fp8_scale_from_amax(float amax) {
  return pow2_ceil(__fmul_rn(fmaxf(amax, kFp8AmaxFloor), 1.0f / kE4m3Max));
}
// e4m3 codes of x/s for two values (lo byte = first), clamped as cpu::quantize_fp8.
__device__ __forceinline__ uint16_t e4m3x2(float x0, float x1, float s) {
  const float2 v =
      make_float2(clamp_sym(__fdiv_rn(x0, s), kE4m3Max), clamp_sym(__fdiv_rn(x1, s), kE4m3Max));
  return uint16_t(__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float e4m3_to_float(uint8_t code) {
  __nv_fp8_e4m3 v;
  v.__x = static_cast<__nv_fp8_storage_t>(code);
  return static_cast<float>(v);
}
// q(x) * s with q = e4m3(clamp(x / s, -448, 448)) (round to nearest even), as a float
// (exactly a BF16 value): the reference's FP8 fake quantisation of activations. x / s is exact
// (s is a power of two). NaN stays NaN, as std::clamp and the CPU's e4m3 encoder leave it.
__device__ __forceinline__ float fp8_fake_quant(float x, float s) {
  const float r = __fdiv_rn(x, s);
  const float v = r < -448.0f ? -448.0f : (r > 448.0f ? 448.0f : r);
  const __nv_fp8_e4m3 q(v);  // satfinite, round to nearest even
  return __fmul_rn(static_cast<float>(q), s);
}
// FP8 fake quantisation of one 128-wide block held by a whole warp, 4 BF16 values a lane
// (`raw`: two BF16 pairs, low half first): the block's amax over the warp, its UE8M0 scale, and
// the 4 quantised values packed the same way.
__device__ __forceinline__ uint2 fp8_fake_quant_warp128(uint2 raw) {
  const float v[4] = {bf16_lo(raw.x & 0xffffu), bf16_lo(raw.x >> 16), bf16_lo(raw.y & 0xffffu),
                      bf16_lo(raw.y >> 16)};
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = fp8_scale_from_amax(amax);
  __nv_bfloat162 q0 = __floats2bfloat162_rn(fp8_fake_quant(v[0], s), fp8_fake_quant(v[1], s));
  __nv_bfloat162 q1 = __floats2bfloat162_rn(fp8_fake_quant(v[2], s), fp8_fake_quant(v[3], s));
  uint2 q;
  q.x = *reinterpret_cast<uint32_t*>(&q0);
  q.y = *reinterpret_cast<uint32_t*>(&q1);
  return q;
}
// 8 values of an FP8 block (of which this thread holds 8) -> 8 codes, packed little-endian.
__device__ __forceinline__ uint2 e4m3x8(const float* x, float s) {
  const uint32_t lo = uint32_t(e4m3x2(x[0], x[1], s)) | (uint32_t(e4m3x2(x[2], x[3], s)) << 16);
  const uint32_t hi = uint32_t(e4m3x2(x[4], x[5], s)) | (uint32_t(e4m3x2(x[6], x[7], s)) << 16);
  return make_uint2(lo, hi);
}

// ---- FP4 e2m1 ----------------------------------------------------------------------------------
__device__ __forceinline__ float fp4_scale_from_amax(float amax) {
  return pow2_ceil(__fmul_rn(fmaxf(amax, kFp4AmaxFloor), 1.0f / kE2m1Max));
}
// dsv4::float_to_e2m1 of clamp(x/s, -6, 6): round to nearest even on {0,.5,1,1.5,2,3,4,6};
// the sign bit follows signbit (so -0 and tiny negatives give code 8); NaN gives 7.
__device__ __forceinline__ uint8_t e2m1_code(float x, float s) {
  const float v = clamp_sym(__fdiv_rn(x, s), kE2m1Max);
  if (v != v) return 0x7;
  const float a = fabsf(v);
  // Ties go to the even index: .25->0, .75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4.
  const uint8_t m = a <= 0.25f   ? 0
                    : a < 0.75f  ? 1
                    : a <= 1.25f ? 2
                    : a < 1.75f  ? 3
                    : a <= 2.5f  ? 4
                    : a < 3.5f   ? 5
                    : a <= 5.0f  ? 6
                                 : 7;
  return uint8_t(((__float_as_uint(v) >> 28) & 0x8) | m);
}

// ---- RoPE ----------------------------------------------------------------------------------
// cos/sin in double of a float angle |x| < 2^20 * pi/2, without libdevice's Payne-Hanek path
// (which needs a stack frame): fdlibm/musl __rem_pio2 medium-range reduction (exact for these
// arguments, up to 3 rounds) and the fdlibm __kernel_sin / __kernel_cos polynomials, all
// operations explicitly rounded. Within ~1 ulp of double, so the float results equal glibc's
// (float)cos((double)x) except for values within ~2^-52 of a float rounding boundary
// (cross-checked on the host against glibc over every angle float(pos) * inv_freq of both RoPE
// tables for pos < 2^20).
__device__ __forceinline__ double fdlibm_ksin(double x, double y) {
  constexpr double S1 = -1.66666666666666324348e-01, S2 = 8.33333333332248946124e-03,
                   S3 = -1.98412698298579493134e-04, S4 = 2.75573137070700676789e-06,
                   S5 = -2.50507602534068634195e-08, S6 = 1.58969099521155010221e-10;
  const double z = __dmul_rn(x, x), w = __dmul_rn(z, z);
  const double r = __dadd_rn(__dadd_rn(S2, __dmul_rn(z, __dadd_rn(S3, __dmul_rn(z, S4)))),
                             __dmul_rn(__dmul_rn(z, w), __dadd_rn(S5, __dmul_rn(z, S6))));
  const double v = __dmul_rn(z, x);
  // x - ((z*(0.5*y - v*r) - y) - v*S1)
  const double a = __dsub_rn(__dmul_rn(0.5, y), __dmul_rn(v, r));
  return __dsub_rn(x, __dsub_rn(__dsub_rn(__dmul_rn(z, a), y), __dmul_rn(v, S1)));
}
__device__ __forceinline__ double fdlibm_kcos(double x, double y) {
  constexpr double C1 = 4.16666666666666019037e-02, C2 = -1.38888888888741095749e-03,
                   C3 = 2.48015872894767294178e-05, C4 = -2.75573143513906633035e-07,
                   C5 = 2.08757232129817482790e-09, C6 = -1.13596475577881948265e-11;
  const double z = __dmul_rn(x, x), w = __dmul_rn(z, z);
  const double r = __dadd_rn(
      __dmul_rn(z, __dadd_rn(C1, __dmul_rn(z, __dadd_rn(C2, __dmul_rn(z, C3))))),
      __dmul_rn(__dmul_rn(w, w), __dadd_rn(C4, __dmul_rn(z, __dadd_rn(C5, __dmul_rn(z, C6))))));
  const double hz = __dmul_rn(0.5, z);
  const double w1 = __dsub_rn(1.0, hz);
  // w + (((1.0-w)-hz) + (z*r-x*y))
  return __dadd_rn(w1, __dadd_rn(__dsub_rn(__dsub_rn(1.0, w1), hz),
                                 __dsub_rn(__dmul_rn(z, r), __dmul_rn(x, y))));
}
__device__ __forceinline__ int hi_exp(double v) {
  return int((uint64_t(__double_as_longlong(v)) >> 52) & 0x7ff);
}
// {cos, sin}(x) rounded to float, x a non-negative float angle below 2^20 * pi/2.
__device__ __forceinline__ float2 cos_sin_of(float xf) {
  constexpr double kInvPio2 = 6.36619772367581382433e-01;
  constexpr double kPio2_1 = 1.57079632673412561417e+00, kPio2_1t = 6.07710050650619224932e-11;
  constexpr double kPio2_2 = 6.07710050630396597660e-11, kPio2_2t = 2.02226624879595063154e-21;
  constexpr double kPio2_3 = 2.02226624871116645580e-21, kPio2_3t = 8.47842766036889956997e-32;
  const double x = double(xf);
  const double fn = rint(__dmul_rn(x, kInvPio2));
  const int n = int(fn);
  double r = __dsub_rn(x, __dmul_rn(fn, kPio2_1));  // exact: fn < 2^20, kPio2_1 has 33 bits
  double w = __dmul_rn(fn, kPio2_1t);
  double y0 = __dsub_rn(r, w);
  const int ex = hi_exp(x);
  if (ex - hi_exp(y0) > 16) {
    double t = r;
    w = __dmul_rn(fn, kPio2_2);
    r = __dsub_rn(t, w);
    w = __dsub_rn(__dmul_rn(fn, kPio2_2t), __dsub_rn(__dsub_rn(t, r), w));
    y0 = __dsub_rn(r, w);
    if (ex - hi_exp(y0) > 49) {
      t = r;
      w = __dmul_rn(fn, kPio2_3);
      r = __dsub_rn(t, w);
      w = __dsub_rn(__dmul_rn(fn, kPio2_3t), __dsub_rn(__dsub_rn(t, r), w));
      y0 = __dsub_rn(r, w);
    }
  }
  const double y1 = __dsub_rn(__dsub_rn(r, y0), w);
  const double s = fdlibm_ksin(y0, y1), c = fdlibm_kcos(y0, y1);
  switch (n & 3) {
    case 0:
      return make_float2(float(c), float(s));
    case 1:
      return make_float2(float(-s), float(c));
    case 2:
      return make_float2(float(-c), float(-s));
    default:
      return make_float2(float(s), float(-c));
  }
}
// cos/sin of float(pos) * f as cpu::RopeTable::cos_sin (fp32 angle, double cos/sin).
__device__ __forceinline__ float2 rope_cos_sin(int pos, float inv_freq) {
  return cos_sin_of(__fmul_rn(float(pos), inv_freq));
}
// cpu::rope_apply on one pair (a, b), BF16 out.
__device__ __forceinline__ void rope_pair(float& a, float& b, float2 cs, bool inverse) {
  const float sn = inverse ? -cs.y : cs.y;
  const float x0 = bf16r(__fsub_rn(__fmul_rn(a, cs.x), __fmul_rn(b, sn)));
  const float x1 = bf16r(__fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs.x)));
  a = x0;
  b = x1;
}

// ---- warp reductions ---------------------------------------------------------------------------
template <int kWidth = 32>
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o /= 2) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <int kWidth = 32>
__device__ __forceinline__ float warp_max_f(float v) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace dsv4::cuda::num
