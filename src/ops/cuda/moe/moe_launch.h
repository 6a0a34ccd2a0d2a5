// How the MoE stages are launched: on the caller's stream, each allowed to start while its
// predecessor finishes (programmatic dependent launch).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "ops/cuda/common/cuda_check.h"

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
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = c.stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = c.pdl && c.stream != nullptr ? 1 : 0;
  DSV4_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace dsv4::cuda::moe
