#include "backends/cuda/device_context.h"

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4 {

DeviceContext::DeviceContext(int device) : device_(device) {
  int n = 0;
  DSV4_CUDA_CHECK(cudaGetDeviceCount(&n));
  DSV4_CHECK(device >= 0 && device < n, "CUDA device ", device, " does not exist (", n,
             " visible)");
  make_current();
  // The greatest priority: a model's side branches run on a stream of the least
  // (CudaModelLimits::concurrent_branches), behind this stream's critical path.
  int least = 0, greatest = 0;
  DSV4_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  DSV4_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamDefault, greatest));
  blas_ = std::make_unique<CudaBlas>();
}

DeviceContext::~DeviceContext() {
  if (stream_) {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    buffers_.clear();
    blas_.reset();
    cudaStreamDestroy(stream_);
  }
}

void DeviceContext::make_current() const {
  DSV4_CUDA_CHECK(cudaSetDevice(device_));
}

uint8_t* DeviceContext::allocate(size_t bytes) {
  buffers_.emplace_back(bytes);
  allocated_ += int64_t(bytes);
  return buffers_.back().data();
}

}  // namespace dsv4
