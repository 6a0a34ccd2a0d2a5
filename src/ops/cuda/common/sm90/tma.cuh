// Tensor Memory Accelerator loads: tiles of a tensor map into shared memory, completion
// counted on an mbarrier (mbarrier.cuh).
#pragma once

#include <cuda.h>  // CUtensorMap (header only; the driver is reached through the runtime)

#include <cstdint>

#include "ops/cuda/common/sm90/smem.cuh"

namespace dsv4::cuda::sm90 {

// L2 cache hints (the encodings CUTLASS uses for TMA::CacheHintSm90).
constexpr uint64_t kEvictFirst = 0x12F0000000000000ull;   // streamed once (weights)
constexpr uint64_t kEvictLast = 0x14F0000000000000ull;    // re-read by many CTAs (activations)
constexpr uint64_t kEvictNormal = 0x1000000000000000ull;  // re-read by a few CTAs at once

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

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) of contiguous global memory
// into shared memory with the bulk copy engine (no tensor map); completion is signalled on `bar`
// as transaction bytes.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t hint) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_u32(bar)), "l"(hint)
      : "memory");
}

}  // namespace dsv4::cuda::sm90
