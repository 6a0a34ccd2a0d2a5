// Owning device memory (plain cudaMalloc, never managed memory) and host<->device copies.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "ops/cuda/common/cuda_check.h"

namespace dsv4::cuda {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n) DSV4_CUDA_CHECK(cudaMalloc(&p_, n * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

  void upload(const std::vector<T>& host) {
    DSV4_CHECK(host.size() == n_, "DeviceBuffer::upload: ", host.size(), " != ", n_);
    if (n_) DSV4_CUDA_CHECK(cudaMemcpy(p_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_) DSV4_CUDA_CHECK(cudaMemcpy(h.data(), p_, bytes(), cudaMemcpyDeviceToHost));
    return h;
  }
  // Fills every byte with `byte` (tests poison outputs this way) and returns when it is done,
  // as upload() does: a plain cudaMemset only queues the fill on the legacy default stream,
  // which kernels on non-blocking streams do not wait for.
  void fill_bytes(int byte) {
    if (!n_) return;
    DSV4_CUDA_CHECK(cudaMemsetAsync(p_, byte, bytes(), cudaStreamLegacy));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  }
  // Fills every byte with `byte` in the order of `stream` (graph-capturable).
  void fill_bytes(int byte, cudaStream_t stream) {
    if (n_) DSV4_CUDA_CHECK(cudaMemsetAsync(p_, byte, bytes(), stream));
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace dsv4::cuda
