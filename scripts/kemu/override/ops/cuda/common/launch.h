// kemu override of launch.h: the launch runs the kernel on the CPU emulator.
#pragma once
#include <cuda_runtime.h>
#include <cstddef>
#include <memory>
#include <tuple>
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
  auto tup = std::make_shared<std::tuple<std::decay_t<KArgs>...>>(std::forward<Args>(args)...);
  const LaunchConfig cc = c;
  ::kemu::submit(c.stream, [=] {
    ::kemu::run_grid(cc.grid, cc.block, cc.smem, cc.cluster, cc.stream,
                     [&] { std::apply(kernel, *tup); });
  });
}
}  // namespace dsv4::cuda
