#include "ops/cuda/common/device.h"

#include <cuda_runtime.h>

#include "core/error.h"

namespace dsv4::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error of a missing driver
    return 0;
  }
  return n;
}

std::string describe_device() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return cat("no CUDA device (", cudaGetErrorString(e), ")");
  }
  if (n == 0) return "no CUDA device";
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "device 0: properties unavailable";
  return cat(p.name, " (sm_", p.major, p.minor, ", ", p.totalGlobalMem >> 30, " GiB)");
}

}  // namespace dsv4::cuda
