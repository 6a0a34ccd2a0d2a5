// Asynchronous global -> shared copies (cp.async, sm_80 and later): issued per thread, grouped
// by commit, completed by wait_group. The "memory" clobbers keep the compiler from moving
// shared-memory accesses across the copies, their commits and waits.
#pragma once

#include <cstdint>

#include "ops/cuda/common/sm90/smem.cuh"

namespace dsv4::cuda::sm90 {

// 16 bytes, cached in L2 only (.cg).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  cp_async_16(smem_u32(smem), gmem);
}
// 16 bytes of which the first `src_bytes` (0..16) are read, the rest zero-filled (.cg).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_addr, const void* gmem,
                                                  int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_16_zfill(void* smem, const void* gmem, int src_bytes) {
  cp_async_16_zfill(smem_u32(smem), gmem, src_bytes);
}
// 8 and 4 bytes (.ca: these sizes cannot bypass L1).
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(smem)), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem)
               : "memory");
}
// Closes the group of copies issued since the previous commit.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Makes `bar` (mbarrier.cuh) track this thread's cp.async copies issued so far: one arrival on it
// when they have all landed. .noinc: that arrival is one of the barrier's expected arrivals (its
// init count includes it).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
               : "memory");
}

}  // namespace dsv4::cuda::sm90
