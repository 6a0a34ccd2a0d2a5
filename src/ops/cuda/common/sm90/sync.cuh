// Barriers beyond __syncthreads: named barriers over some warps of a CTA, the cluster barrier,
// and programmatic dependent launch (a kernel overlapping the tail of its predecessor).
#pragma once

namespace dsv4::cuda::sm90 {

// ---- named barriers ------------------------------------------------------------------------
// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads, a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Arrives without waiting (the producer side of a hand-off; the consumers bar.sync).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- cluster barrier -----------------------------------------------------------------------
// Every thread of every CTA of the cluster, split into its two halves; release/acquire order
// shared-memory writes before it with distributed reads after it.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// ---- programmatic dependent launch ---------------------------------------------------------
// Blocks until the grid this one depends on has completed and its writes are visible (no-op
// when the kernel was launched without the programmatic-serialisation attribute).
__device__ __forceinline__ void griddep_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
// Lets the dependent grid start launching (its blocks still wait in griddep_wait).
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace dsv4::cuda::sm90
