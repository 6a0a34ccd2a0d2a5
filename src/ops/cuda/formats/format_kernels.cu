#include <cuda_bf16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/formats/format_kernels.h"

namespace dsv4::cuda {
namespace {

__global__ void decode_kernel(float* e4m3, float* e2m1) {
  const int i = threadIdx.x;
  __nv_fp8_e4m3 v;
  v.__x = static_cast<__nv_fp8_storage_t>(i);
  e4m3[i] = static_cast<float>(v);
  if (i < 16) {
    __nv_fp4_e2m1 f;
    f.__x = static_cast<__nv_fp4_storage_t>(i);
    e2m1[i] = static_cast<float>(f);
  }
}

__global__ void encode_kernel(const float* x, int n, uint8_t* e4m3, uint16_t* bf16) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  e4m3[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
  __nv_bfloat16 b = __float2bfloat16_rn(x[i]);
  bf16[i] = *reinterpret_cast<uint16_t*>(&b);
}

template <typename T>
struct DeviceBuffer {
  T* p = nullptr;
  explicit DeviceBuffer(size_t n) { DSV4_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T) + 1)); }
  ~DeviceBuffer() { cudaFree(p); }
};

}  // namespace

void decode_all_codes(std::vector<float>& e4m3, std::vector<float>& e2m1) {
  DeviceBuffer<float> a(256), b(16);
  decode_kernel<<<1, 256>>>(a.p, b.p);
  DSV4_CUDA_CHECK(cudaGetLastError());
  e4m3.resize(256);
  e2m1.resize(16);
  DSV4_CUDA_CHECK(cudaMemcpy(e4m3.data(), a.p, 256 * 4, cudaMemcpyDeviceToHost));
  DSV4_CUDA_CHECK(cudaMemcpy(e2m1.data(), b.p, 16 * 4, cudaMemcpyDeviceToHost));
}

void encode_on_device(const std::vector<float>& x, std::vector<uint8_t>& e4m3,
                      std::vector<uint16_t>& bf16) {
  const int n = static_cast<int>(x.size());
  e4m3.assign(n, 0);
  bf16.assign(n, 0);
  if (n == 0) return;
  DeviceBuffer<float> dx(n);
  DeviceBuffer<uint8_t> de(n);
  DeviceBuffer<uint16_t> db(n);
  DSV4_CUDA_CHECK(cudaMemcpy(dx.p, x.data(), n * 4, cudaMemcpyHostToDevice));
  encode_kernel<<<(n + 255) / 256, 256>>>(dx.p, n, de.p, db.p);
  DSV4_CUDA_CHECK(cudaGetLastError());
  DSV4_CUDA_CHECK(cudaMemcpy(e4m3.data(), de.p, n, cudaMemcpyDeviceToHost));
  DSV4_CUDA_CHECK(cudaMemcpy(bf16.data(), db.p, n * 2, cudaMemcpyDeviceToHost));
}

}  // namespace dsv4::cuda
