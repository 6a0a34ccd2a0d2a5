// The BF16-weight linears the reference does not quantise, on cuBLAS: the compressors' wkv /
// wgate (fp32 output, cpu::linear kF32 on BF16 values) and the indexer's weights_proj (BF16
// output, cpu::linear kBf16). BF16 x BF16 products are exact in fp32 and cuBLAS accumulates in
// fp32 (CUBLAS_COMPUTE_32F, no reduced-precision modes); the CPU sums the products in double
// and rounds once, so results agree to fp32 rounding (fp32 out) or to the rare BF16 rounding
// that fp32 rounding decides (BF16 out). cuBLAS picks its kernel by shape, so these two are not
// bit-identical across batch sizes. A fixed workspace keeps every call graph-capturable.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/common/device_buffer.h"

namespace dsv4 {

class CudaBlas {
 public:
  CudaBlas();
  ~CudaBlas();
  CudaBlas(const CudaBlas&) = delete;
  CudaBlas& operator=(const CudaBlas&) = delete;

  cublasHandle_t handle() const { return h_; }

  // y[m, n] (row-major, row stride ldy) = x[m, k] (row stride ldx) . w[n, k]^T; fp32 y when
  // `f32_out`, else BF16 y.
  void linear(const __nv_bfloat16* x, int64_t ldx, int m, const __nv_bfloat16* w, int n, int k,
              void* y, int64_t ldy, bool f32_out, cudaStream_t stream);

 private:
  cublasHandle_t h_ = nullptr;
  cuda::DeviceBuffer<uint8_t> workspace_;
};

}  // namespace dsv4
