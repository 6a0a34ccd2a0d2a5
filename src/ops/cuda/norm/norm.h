// RMSNorm with weights on the GPU, the numerics of cpu::rms_norm (ops/cpu/norm.h): per row,
// mean(x^2) summed in fp64 and rounded to fp32, rs = 1 / sqrt(mean + eps) in fp32,
// y = bf16(w * (x * rs)) with separately rounded products — bit-identical to the CPU; optionally
// with y's FP8 activation quantisation fused in.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda {

struct RmsNormParams {
  const __nv_bfloat16* x = nullptr;  // [rows, n], row stride ldx elements (0: n)
  int64_t ldx = 0;
  int rows = 0;
  int n = 0;                              // multiple of 8, <= 16384
  const __nv_bfloat16* weight = nullptr;  // [n]
  float eps = 1e-6f;
  __nv_bfloat16* y = nullptr;  // [rows, n], row stride ldy (0: n); may be x (in place)
  int64_t ldy = 0;
  // Optional, for an FP8 GEMM that reads y next: y quantised in the same pass, bytes identical
  // to quantize_act_fp8 of the stored y (ops/cuda/gemm/fp8_gemm.h: e4m3 codes [rows, n] packed,
  // fp32 transposed scales [n/128, q_ld_scales] with the pad rows up to a multiple of 4 as 0).
  // Needs n % 128 == 0.
  uint8_t* q_codes = nullptr;
  float* q_scales_t = nullptr;
  int q_ld_scales = 0;  // >= rows rounded up to 4, multiple of 4
  // Programmatic dependent launch: start while the kernel before finishes (x is read after
  // griddepcontrol.wait); graph-capturable.
  bool pdl = false;
};
void rms_norm(const RmsNormParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
