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
    // Without any driver the runtime reports "driver version is insufficient": say what is
    // actually missing. cudaDriverGetVersion gives 0 when no driver is installed.
    int driver = 0, runtime = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
    if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
    (void)cudaGetLastError();
    if (driver == 0) return "no NVIDIA driver is installed or loaded";
    if (e == cudaErrorInsufficientDriver)
      return cat("the NVIDIA driver supports CUDA ", driver / 1000, ".", driver % 1000 / 10,
                 ", this build's runtime needs CUDA ", runtime / 1000, ".", runtime % 1000 / 10);
    return cat("no CUDA device (", cudaGetErrorString(e), ")");
  }
  if (n == 0) return "no CUDA device";
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "device 0: properties unavailable";
  return cat(p.name, " (sm_", p.major, p.minor, ", ", p.totalGlobalMem >> 30, " GiB)");
}

}  // namespace dsv4::cuda
