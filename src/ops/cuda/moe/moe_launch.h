// How the MoE stages are launched: on the caller's stream, each allowed to start while its
// predecessor finishes (programmatic dependent launch, ops/cuda/common/launch.h).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "ops/cuda/common/launch.h"

namespace dsv4::cuda::moe {

struct LaunchCtx {
  cudaStream_t stream = nullptr;
  bool pdl = true;
};

// Launches `kernel`, allowing it to start while the previous kernel on the stream finishes
// (every MoE kernel waits for its predecessor with sm90::griddep_wait() before touching its
// data). On the legacy default stream the launch is a plain one.
template <typename... KArgs, typename... Args>
void launch_kernel(const LaunchCtx& c, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                   Args&&... args) {
  LaunchConfig cfg;
  cfg.grid = grid;
  cfg.block = block;
  cfg.smem = smem;
  cfg.stream = c.stream;
  cfg.pdl = c.pdl && c.stream != nullptr;
  ::dsv4::cuda::launch_kernel(cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace dsv4::cuda::moe
