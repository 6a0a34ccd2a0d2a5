// Hopper warpgroup primitives for the sparse-attention kernel: the three wgmma shapes it uses
// (CuTe's sm_90a atoms underneath), shared-memory matrix descriptors for 128-byte-swizzled
// BF16 tiles, named barriers, the async-proxy fence and register reallocation.
//
// Tiles are stored as "regions" of 64 rows x 64 BF16 (128 bytes per row, rows 1024-byte
// grouped by eight), the 16-byte chunk index XOR-ed with row % 8 (CuTe's Swizzle<3,4,3>, i.e.
// GMMA::Layout_K_SW128_Atom). Wider tiles are consecutive regions along the 64-column axis.
#pragma once

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>

namespace dsv4::cuda::wg {

constexpr uint32_t kRegionBytes = 64 * 128;

// Byte offset of element (row, col) in a region-tiled 64-row BF16 tile.
__device__ __forceinline__ uint32_t swz_offset(int row, int col) {
  return uint32_t(col >> 6) * kRegionBytes + uint32_t(row) * 128u +
         (uint32_t(((col & 63) >> 3) ^ (row & 7)) << 4) + uint32_t(col & 7) * 2u;
}

// Shared-memory matrix descriptor, 128-byte swizzle (layout type 1), base offset 0.
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo_bytes,
                                              uint32_t sbo_bytes) {
  return uint64_t((smem_addr & 0x3FFFFu) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) |
         (uint64_t(sbo_bytes >> 4) << 32) | (uint64_t(1) << 62);
}
// K-major operand (rows = M or N, 64-column regions along K), k16 step `s`.
__device__ __forceinline__ uint64_t desc_kmajor(uint32_t tile, int s) {
  return make_desc(tile + uint32_t(s >> 2) * kRegionBytes + uint32_t(s & 3) * 32u, 16u, 1024u);
}
// MN-major B operand (rows = K, 64-column regions along N), k16 step `s`, N starting at region rb.
__device__ __forceinline__ uint64_t desc_mnmajor(uint32_t tile, int rb, int s) {
  return make_desc(tile + uint32_t(rb) * kRegionBytes + uint32_t(s) * 2048u, kRegionBytes, 1024u);
}

__device__ __forceinline__ void fence() {
  cute::warpgroup_arrive();
}
__device__ __forceinline__ void commit() {
  cute::warpgroup_commit_batch();
}
template <int N>
__device__ __forceinline__ void wait() {
  cute::warpgroup_wait<N>();
}
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(d[i]);
}

namespace gm = cute::SM90::GMMA;

template <size_t... I>
__device__ __forceinline__ void ss_64x64(float (&d)[32], uint64_t da, uint64_t db, bool acc,
                                         std::index_sequence<I...>) {
  gm::MMA_64x64x16_F32BF16BF16_SS<gm::Major::K, gm::Major::K>::fma(
      da, db, d[I]..., acc ? gm::ScaleOut::One : gm::ScaleOut::Zero);
}
// D[64 x 64] (+)= A[64 x 16] B[16 x 64], both K-major in smem.
__device__ __forceinline__ void mma_64x64_ss(float (&d)[32], uint64_t da, uint64_t db, bool acc) {
  ss_64x64(d, da, db, acc, std::make_index_sequence<32>{});
}

template <size_t... I>
__device__ __forceinline__ void rs_64x256(float (&d)[128], const uint32_t (&a)[4], uint64_t db,
                                          std::index_sequence<I...>) {
  gm::MMA_64x256x16_F32BF16BF16_RS<gm::Major::K, gm::Major::MN>::fma(a[0], a[1], a[2], a[3], db,
                                                                     d[I]..., gm::ScaleOut::One);
}
// D[64 x 256] += A[64 x 16] (registers) B[16 x 256] (smem, MN-major).
__device__ __forceinline__ void mma_64x256_rs(float (&d)[128], const uint32_t (&a)[4],
                                              uint64_t db) {
  rs_64x256(d, a, db, std::make_index_sequence<128>{});
}

template <size_t... I>
__device__ __forceinline__ void ss_64x256(float (&d)[128], uint64_t da, uint64_t db,
                                          std::index_sequence<I...>) {
  gm::MMA_64x256x16_F32BF16BF16_SS<gm::Major::K, gm::Major::MN>::fma(da, db, d[I]...,
                                                                     gm::ScaleOut::One);
}
// D[64 x 256] += A[64 x 16] (smem, K-major) B[16 x 256] (smem, MN-major).
__device__ __forceinline__ void mma_64x256_ss(float (&d)[128], uint64_t da, uint64_t db) {
  ss_64x256(d, da, db, std::make_index_sequence<128>{});
}

// Named barriers (id 1..15; 0 is __syncthreads): `count` threads, a multiple of 32.
__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Generic-proxy shared-memory writes become visible to wgmma (async proxy) reads.
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace dsv4::cuda::wg
