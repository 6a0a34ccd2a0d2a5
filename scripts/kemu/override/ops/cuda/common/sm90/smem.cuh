#pragma once
#include <cstdint>
#include <cstring>
namespace dsv4::cuda::sm90 {
inline uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
constexpr uint32_t kSw128RegionBytes = 64 * 128;
inline uint32_t sw128_bf16_offset(int row, int col) {
  return uint32_t(col >> 6) * kSw128RegionBytes + uint32_t(row) * 128u +
         (uint32_t(((col & 63) >> 3) ^ (row & 7)) << 4) + uint32_t(col & 7) * 2u;
}
inline void fence_proxy_async_smem() {}
inline void fence_proxy_async_smem_cluster() {}
inline uint32_t cluster_ctarank() {
  return ::kemu::cluster_rank();
}
inline uint32_t map_to_rank(uint32_t a, uint32_t r) {
  return ::kemu::map_rank(a, r);
}
inline void st_cluster_16(uint32_t a, uint4 v) {
  std::memcpy(::kemu::smem_ptr(a), &v, 16);
}
inline void st_cluster_4(uint32_t a, uint32_t v) {
  std::memcpy(::kemu::smem_ptr(a), &v, 4);
}
inline uint32_t ld_cluster_4(uint32_t a) {
  uint32_t v;
  std::memcpy(&v, ::kemu::smem_ptr(a), 4);
  return v;
}
}  // namespace dsv4::cuda::sm90
