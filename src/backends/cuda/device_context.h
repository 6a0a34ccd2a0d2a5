// What the CUDA backend runs on: one device, one stream, one cuBLAS handle and the device
// memory its users plan (the activation arena). Handed to the model and the runner rather
// than owned by them, so several ranks can share a GPU (each with its own context) or each
// have their own.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backends/cuda/blas.h"
#include "ops/cuda/common/device_buffer.h"

namespace dsv4 {

class DeviceContext {
 public:
  // Makes `device` current on the calling thread and creates the stream (blocking: work its
  // callers enqueue on the legacy default stream, such as cudaMemcpy of inputs and cache
  // uploads, is ordered before the model's kernels) and the cuBLAS handle.
  explicit DeviceContext(int device = 0);
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  CudaBlas& blas() { return *blas_; }
  // Makes this context's device current on the calling thread.
  void make_current() const;

  // A device allocation owned by the context (freed with it); counted in allocated_bytes().
  uint8_t* allocate(size_t bytes);
  int64_t allocated_bytes() const { return allocated_; }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CudaBlas> blas_;
  std::vector<cuda::DeviceBuffer<uint8_t>> buffers_;
  int64_t allocated_ = 0;
};

}  // namespace dsv4
