#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include "ops/cuda/common/sm90/smem.cuh"
namespace dsv4::cuda::sm90 {
inline void warpgroup_arrive() {}
inline void warpgroup_commit_batch() {}
template <int N>
inline void warpgroup_wait() {
  static_assert(N >= 0 && N <= 7);
}
inline void warpgroup_fence_operand(float&) {}
inline void warpgroup_fence_operand(uint32_t&) {}
template <int N>
inline void warpgroup_fence_operands(float (&)[N]) {}
template <int N>
inline void warpgroup_reg_alloc() {}
template <int N>
inline void warpgroup_reg_dealloc() {}
inline uint64_t make_smem_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t((smem_addr & 0x3FFFFu) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) |
         (uint64_t(sbo_bytes >> 4) << 32) | (uint64_t(1) << 62);
}
inline uint64_t desc_k_sw128(uint32_t smem_addr) {
  return make_smem_desc_sw128(smem_addr, 16u, 1024u);
}
inline uint64_t desc_region_kmajor(uint32_t tile, int s) {
  return make_smem_desc_sw128(tile + uint32_t(s >> 2) * kSw128RegionBytes + uint32_t(s & 3) * 32u,
                              16u, 1024u);
}
inline uint64_t desc_region_mnmajor(uint32_t tile, int rb, int s) {
  return make_smem_desc_sw128(tile + uint32_t(rb) * kSw128RegionBytes + uint32_t(s) * 2048u,
                              kSw128RegionBytes, 1024u);
}
namespace gmma {
enum class Major { K = 0, MN = 1 };
}
using gmma::Major;
template <int N>
struct Fp8MmaSS {
  static void wgmma(uint64_t da, uint64_t db, float* d, bool scale_d) {
    ::kemu::WgmmaOp op{1, N, false, false, da, db, {0, 0, 0, 0}, d, scale_d};
    ::kemu::wgmma(op);
  }
};
template <int N, Major kMajorB = Major::K>
struct Bf16MmaSS {
  static void wgmma(uint64_t da, uint64_t db, float* d, bool scale_d) {
    ::kemu::WgmmaOp op{0, N, kMajorB == Major::MN, false, da, db, {0, 0, 0, 0}, d, scale_d};
    ::kemu::wgmma(op);
  }
};
template <int N, Major kMajorB = Major::K>
struct Bf16MmaRS {
  static void wgmma(const uint32_t* a, uint64_t db, float* d, bool scale_d) {
    ::kemu::WgmmaOp op{0, N,      kMajorB == Major::MN, true, 0, db, {a[0], a[1], a[2], a[3]},
                       d, scale_d};
    ::kemu::wgmma(op);
  }
};
}  // namespace dsv4::cuda::sm90
