// kemu override of launch.h: the launch runs the kernel on the CPU emulator.
#pragma once
#include <cuda_runtime.h>
#include <cstddef>
#include <utility>
#include "ops/cuda/common/cuda_check.h"

namespace dsv4::cuda {
struct LaunchConfig {
  dim3 grid;
  dim3 block;
  size_t smem = 0;
  cudaStream_t stream = nullptr;
  bool pdl = false;
  dim3 cluster = dim3(1, 1, 1);
};
template <typename... KArgs, typename... Args>
void launch_kernel(const LaunchConfig& c, void (*kernel)(KArgs...), Args&&... args) {
  ::kemu::launch(kernel, c.grid, c.block, c.smem, c.cluster, c.stream, std::forward<Args>(args)...);
}
}  // namespace dsv4::cuda
