// Shared-memory addressing for the Hopper kernels: the 32-bit shared-window address that PTX
// instructions take, the 128-byte swizzle that TMA writes and the wgmma descriptors read, the
// fence that hands shared-memory writes of ordinary instructions to the async proxy, and the
// shared memory of the other CTAs of a cluster.
#pragma once

#include <cstdint>

namespace dsv4::cuda::sm90 {

// Address of a shared-memory object in the shared window (what the PTX operands [%r] take).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- 128-byte swizzle ----------------------------------------------------------------------
// Rows of 128 bytes, grouped by eight into 1024-byte atoms; the 16-byte chunk c of row r is
// stored at chunk c ^ (r % 8) (CuTe's Swizzle<3,4,3>, GMMA::Layout_K_SW128_Atom). A BF16 tile
// wider than 64 columns is a sequence of "regions" of 64 rows x 64 columns along the columns.
constexpr uint32_t kSw128RegionBytes = 64 * 128;

// Byte offset of element (row, col) of a region-tiled 64-row BF16 tile.
__device__ __forceinline__ uint32_t sw128_bf16_offset(int row, int col) {
  return uint32_t(col >> 6) * kSw128RegionBytes + uint32_t(row) * 128u +
         (uint32_t(((col & 63) >> 3) ^ (row & 7)) << 4) + uint32_t(col & 7) * 2u;
}

// ---- proxies -------------------------------------------------------------------------------
// Shared memory written by ordinary stores or cp.async (generic proxy) becomes visible to the
// async proxy (wgmma operands, TMA); the readers still need a barrier after it.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The same, for shared memory of the cluster's CTAs (distributed shared memory) as well.
__device__ __forceinline__ void fence_proxy_async_smem_cluster() {
  asm volatile("fence.proxy.async.shared::cluster;\n" ::: "memory");
}

// ---- distributed shared memory (thread-block clusters) -------------------------------------
// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// The shared::cluster address of the object at shared-window address `addr` in CTA `rank` of
// the cluster (the CTAs run the same kernel, so the object sits at the same offset there).
__device__ __forceinline__ uint32_t map_to_rank(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// Stores to a shared::cluster address (map_to_rank).
__device__ __forceinline__ void st_cluster_16(uint32_t addr, uint4 v) {
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_cluster_4(uint32_t addr, uint32_t v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// A load from a shared::cluster address (map_to_rank).
__device__ __forceinline__ uint32_t ld_cluster_4(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

}  // namespace dsv4::cuda::sm90
