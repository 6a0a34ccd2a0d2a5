// One kernel launch through cudaLaunchKernelEx with the launch attributes the project uses:
// programmatic dependent launch (the kernel may start while the one before it on the stream
// finishes; it must wait with sm90::griddep_wait() before reading that kernel's output) and an
// optional thread-block cluster shape.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "ops/cuda/common/cuda_check.h"

namespace dsv4::cuda {

struct LaunchConfig {
  dim3 grid;
  dim3 block;
  size_t smem = 0;  // dynamic shared memory bytes
  cudaStream_t stream = nullptr;
  // cudaLaunchAttributeProgrammaticStreamSerialization.
  bool pdl = false;
  // cudaLaunchAttributeClusterDimension, set only for a cluster of more than one CTA.
  dim3 cluster = dim3(1, 1, 1);
};

template <typename... KArgs, typename... Args>
void launch_kernel(const LaunchConfig& c, void (*kernel)(KArgs...), Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = c.grid;
  cfg.blockDim = c.block;
  cfg.dynamicSmemBytes = c.smem;
  cfg.stream = c.stream;
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (c.cluster.x * c.cluster.y * c.cluster.z > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = c.cluster.x;
    attrs[n].val.clusterDim.y = c.cluster.y;
    attrs[n].val.clusterDim.z = c.cluster.z;
    ++n;
  }
  if (c.pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  DSV4_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace dsv4::cuda
