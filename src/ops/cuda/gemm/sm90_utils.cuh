// Thin wrappers over the Hopper (sm_90a) instructions the hand-written kernels use: mbarriers,
// TMA tile loads, wgmma shared-memory descriptors, programmatic dependent launch. Device code
// only; every wrapper is one PTX instruction (or a try-wait loop) so the kernels read like the
// PTX they issue.
#pragma once

#include <cuda.h>  // CUtensorMap (header only; the driver is reached through the runtime)

#include <cstdint>

namespace dsv4::cuda::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers ---------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
// Makes initialised barriers visible to the async proxy (TMA) and to the other threads.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Waits until the phase with parity `parity` has completed (first wait of a fresh barrier: 0).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred P1;\n"
      "LAB_WAIT:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1, %2;\n\t"
      "@P1 bra DONE;\n\t"
      "bra LAB_WAIT;\n"
      "DONE:\n\t}" ::"r"(smem_u32(bar)),
      "r"(parity), "r"(0x989680)
      : "memory");
}

// ---- TMA ---------------------------------------------------------------------------------
// L2 cache hints (the encodings CUTLASS uses for TMA::CacheHintSm90).
constexpr uint64_t kEvictFirst = 0x12F0000000000000ull;  // streamed once (weights)
constexpr uint64_t kEvictLast = 0x14F0000000000000ull;   // re-read by many CTAs (activations)

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// Loads the box at element coordinates (c0 innermost, c1) into shared memory; completion is
// signalled on `bar` as transaction bytes (the full box, out-of-bounds elements zero-filled).
__device__ __forceinline__ void tma_load_2d(const CUtensorMap* map, uint64_t* bar, void* dst,
                                            int c0, int c1, uint64_t hint) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "l"(hint)
      : "memory");
}

// ---- wgmma -------------------------------------------------------------------------------
// Descriptor of a K-major operand tile stored as TMA writes it with SWIZZLE_128B: rows of
// 128 bytes, 8-row groups 1024 bytes apart, the tile based on a 1024-byte boundary. Stepping
// along K inside the 128-byte row adds the byte offset to the start address.
__device__ __forceinline__ uint64_t desc_k_sw128(const void* smem) {
  const uint64_t addr = smem_u32(smem);
  uint64_t d = (addr & 0x3FFFFull) >> 4;  // start address, 16-byte units
  d |= uint64_t(1) << 16;                 // leading byte offset: unused for swizzled K-major
  d |= uint64_t(1024 >> 4) << 32;         // stride byte offset: next 8-row group
  d |= uint64_t(1) << 62;                 // SWIZZLE_128B
  return d;
}

// ---- programmatic dependent launch ------------------------------------------------------
// Blocks until the grid this one depends on has completed and its writes are visible (no-op
// when the kernel was launched without the programmatic-serialisation attribute).
__device__ __forceinline__ void griddep_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
// Lets the dependent grid start launching (its blocks still wait in griddep_wait).
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Cluster-wide barrier (every thread of every CTA of the cluster), split into its two halves;
// release/acquire order shared-memory writes before it with distributed reads after it.
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

// Named barrier over `threads` threads (warp-multiple), id 1..15 (0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace dsv4::cuda::sm90
