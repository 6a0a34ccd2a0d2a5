// Host <-> device helpers of the GPU tests and benchmarks: BF16 device buffers seen as
// __nv_bfloat16, copies of float host values to BF16 device memory and back, and copies out of
// device memory the caller does not own (workspaces, raw pointers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/device_buffer.h"
#include "support/bf16_vectors.h"

namespace dsv4::test {

template <typename T>
__nv_bfloat16* bf16_ptr(cuda::DeviceBuffer<T>& b) {
  return reinterpret_cast<__nv_bfloat16*>(b.data());
}
template <typename T>
const __nv_bfloat16* bf16_ptr(const cuda::DeviceBuffer<T>& b) {
  return reinterpret_cast<const __nv_bfloat16*>(b.data());
}

// n elements at device address p.
template <typename T>
std::vector<T> fetch(const T* p, size_t n) {
  std::vector<T> h(n);
  if (n) DSV4_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}
inline std::vector<float> fetch_bf16(const __nv_bfloat16* p, size_t n) {
  return from_bf16_bits(fetch(reinterpret_cast<const uint16_t*>(p), n));
}

// BF16 device copies of float host values (BF16 values: exact) and back.
inline cuda::DeviceBuffer<uint16_t> to_device_bf16(const std::vector<float>& v) {
  return cuda::DeviceBuffer<uint16_t>(to_bf16_bits(v));
}
inline void upload_bf16(cuda::DeviceBuffer<uint16_t>& dst, const std::vector<float>& v) {
  dst.upload(to_bf16_bits(v));
}
// After the device has finished everything queued (the values are an op's output).
inline std::vector<float> from_device_bf16(const void* p, size_t n) {
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  return fetch_bf16(static_cast<const __nv_bfloat16*>(p), n);
}

}  // namespace dsv4::test
