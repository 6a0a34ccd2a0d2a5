// One-time set-up per device. Kernel function attributes (opt-in shared memory, cluster sizes)
// and occupancy-derived grids belong to a device: a process that drives several GPUs from its
// threads (the parallel engine over NCCL) must set them on each, so a function-static "once"
// is not enough.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4::cuda {

constexpr int kMaxDevices = 64;

inline int current_device() {
  int d = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&d));
  DSV4_CHECK(d >= 0 && d < kMaxDevices, "CUDA device ", d, " (at most ", kMaxDevices, ")");
  return d;
}

// Streaming multiprocessors of the current device (read once per device).
inline int sm_count() {
  static std::atomic<int> cached[kMaxDevices];  // zero-initialised (static storage)
  const int dev = current_device();
  int n = cached[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cached[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Runs setup() the first time it is called with `done` on the current device (two threads
// racing on one device may both run it: the set-ups are idempotent).
template <typename F>
void once_per_device(std::atomic<uint64_t>& done, F&& setup) {
  const uint64_t bit = uint64_t(1) << current_device();
  if (done.load(std::memory_order_acquire) & bit) return;
  setup();
  done.fetch_or(bit, std::memory_order_acq_rel);
}

// Opts kKernel into `bytes` of dynamic shared memory (the most any of its launches asks for),
// once per device: one flag per kernel instance, so callers need no static of their own.
template <auto kKernel>
void opt_in_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> done{0};
  once_per_device(done, [&] {
    DSV4_CUDA_CHECK(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  });
}

}  // namespace dsv4::cuda
