// Global-memory reads with cache hints, for data one kernel touches once (the sparse
// attention's gathered keys): 16-byte non-coherent loads whose lines are first in line for
// eviction from L2, and L2 prefetches that start a gather's HBM traffic a stage before its
// loads.
#pragma once

#include <cstdint>

namespace dsv4::cuda::sm90 {

// An L2 access policy: lines the policy's accesses touch are evicted first.
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}

// 16 bytes, read-only for the kernel's lifetime, L2 policy `pol`. Allocated in L1 on purpose:
// a thread's two 16-byte loads of one 32-byte sector then cost one L2 request, not two.
__device__ __forceinline__ uint4 ld_nc_16(const void* p, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ uint2 ld_nc_8(const void* p, uint64_t pol) {
  uint2 v;
  asm volatile("ld.global.nc.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;\n"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p), "l"(pol));
  return v;
}

// Brings `bytes` (a multiple of 16) at the 16-byte aligned `p` into L2 without waiting.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}
// Brings the line holding `p` into L2 without waiting.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

}  // namespace dsv4::cuda::sm90
