// RMSNorm with weights on the GPU, the numerics of cpu::rms_norm (ops/cpu/norm.h): per row,
// mean(x^2) summed in fp64 and rounded to fp32, rs = 1 / sqrt(mean + eps) in fp32,
// y = bf16(w * (x * rs)) with separately rounded products — bit-identical to the CPU.
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
};
void rms_norm(const RmsNormParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
