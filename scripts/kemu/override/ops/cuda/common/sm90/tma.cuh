#pragma once
#include <cuda.h>
#include <cstdint>
#include "ops/cuda/common/sm90/smem.cuh"
namespace dsv4::cuda::sm90 {
constexpr uint64_t kEvictFirst = 0x12F0000000000000ull;
constexpr uint64_t kEvictLast = 0x14F0000000000000ull;
constexpr uint64_t kEvictNormal = 0x1000000000000000ull;
inline void prefetch_tensormap(const CUtensorMap*) {}
inline void tma_load_2d(const CUtensorMap* m, uint64_t* bar, void* dst, int c0, int c1, uint64_t) {
  ::kemu::tma_load_2d(m, bar, dst, c0, c1);
}
inline void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t) {
  ::kemu::bulk_copy(dst, src, bytes, bar);
}
}  // namespace dsv4::cuda::sm90
