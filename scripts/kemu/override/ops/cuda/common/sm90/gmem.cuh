#pragma once
#include <cstdint>
#include <cstring>
namespace dsv4::cuda::sm90 {
inline uint64_t l2_policy_evict_first() {
  return 0;
}
inline uint4 ld_nc_16(const void* p, uint64_t) {
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline uint2 ld_nc_8(const void* p, uint64_t) {
  uint2 v;
  std::memcpy(&v, p, 8);
  return v;
}
inline void prefetch_l2_bulk(const void*, uint32_t) {}
inline void prefetch_l2(const void*) {}
}  // namespace dsv4::cuda::sm90
