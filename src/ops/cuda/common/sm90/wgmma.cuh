// Hopper warpgroup MMA (wgmma, sm_90a): the fences that order it against the registers and
// shared memory it reads, shared-memory matrix descriptors for 128-byte-swizzled tiles
// (smem.cuh), the MMA shapes the kernels issue (CuTe's sm_90a atoms underneath, selected by N),
// and warpgroup register reallocation for warp-specialised kernels.
//
// One MMA group: warpgroup_fence_operand on the accumulators (and register A operands),
// warpgroup_arrive, the MMAs, warpgroup_commit_batch; later warpgroup_wait<n> retires all but
// the n most recent groups, and the operands are fenced again before ordinary code reads them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>

#include "ops/cuda/common/sm90/smem.cuh"

namespace dsv4::cuda::sm90 {

// ---- ordering ------------------------------------------------------------------------------
// Registers and shared memory written before this are visible to the MMAs issued after it.
__device__ __forceinline__ void warpgroup_arrive() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void warpgroup_commit_batch() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed groups are in flight.
template <int N>
__device__ __forceinline__ void warpgroup_wait() {
  static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0..7");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads/writes of a register across the asynchronous MMA (it
// reads A and updates the accumulators until the matching wait).
__device__ __forceinline__ void warpgroup_fence_operand(float& r) {
  asm volatile("" : "+f"(r)::"memory");
}
__device__ __forceinline__ void warpgroup_fence_operand(uint32_t& r) {
  asm volatile("" : "+r"(r)::"memory");
}
template <int N>
__device__ __forceinline__ void warpgroup_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) warpgroup_fence_operand(d[i]);
}

// ---- register reallocation ------------------------------------------------------------------
// Every warp of the warpgroup raises (lowers) its per-thread register budget to N.
template <int N>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- shared-memory matrix descriptors ----------------------------------------------------------
// 128-byte swizzle (layout type 1), base offset 0: start address, leading and stride byte
// offsets, all in 16-byte units. The tile must start on a 1024-byte boundary; stepping along
// K inside a 128-byte row adds the byte offset to the start address (+2 per 32 bytes).
__device__ __forceinline__ uint64_t make_smem_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes,
                                                         uint32_t sbo_bytes) {
  return uint64_t((smem_addr & 0x3FFFFu) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) |
         (uint64_t(sbo_bytes >> 4) << 32) | (uint64_t(1) << 62);
}
// K-major operand as TMA writes it with SWIZZLE_128B (or cp.async with the same swizzle): rows
// of 128 bytes along K, 8-row groups 1024 bytes apart (the leading offset is unused).
__device__ __forceinline__ uint64_t desc_k_sw128(uint32_t smem_addr) {
  return make_smem_desc_sw128(smem_addr, 16u, 1024u);
}
// Region-tiled BF16 tiles (smem.cuh), k16 step `s`: K-major (rows = M or N, 64-column regions
// along K) and MN-major B (rows = K, 64-column regions along N, starting at region rb).
__device__ __forceinline__ uint64_t desc_region_kmajor(uint32_t tile, int s) {
  return make_smem_desc_sw128(tile + uint32_t(s >> 2) * kSw128RegionBytes + uint32_t(s & 3) * 32u,
                              16u, 1024u);
}
__device__ __forceinline__ uint64_t desc_region_mnmajor(uint32_t tile, int rb, int s) {
  return make_smem_desc_sw128(tile + uint32_t(rb) * kSw128RegionBytes + uint32_t(s) * 2048u,
                              kSw128RegionBytes, 1024u);
}

// ---- MMA shapes ----------------------------------------------------------------------------
// D[64 x N] (+)= A[64 x K] * B[K x N] with fp32 accumulators d[0 .. N/2) per thread; scale_d =
// false overwrites D. A operand from shared memory (SS, descriptor) or registers (RS, four
// BF16x2 words); B always from shared memory. `d` may be longer than N/2: only its first N/2
// accumulators take part. A shape no kernel uses yet fails to compile: add it to the selector.
namespace gmma = cute::SM90::GMMA;
using gmma::Major;

template <class Atom, size_t... I>
__device__ __forceinline__ void wgmma_ss(uint64_t da, uint64_t db, float* d, bool scale_d,
                                         std::index_sequence<I...>) {
  Atom::fma(da, db, d[I]..., scale_d ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}
template <class Atom, size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t* a, uint64_t db, float* d, bool scale_d,
                                         std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], db, d[I]...,
            scale_d ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}

// FP8 e4m3 x e4m3, K = 32 (32 bytes of each operand's K-major rows).
template <int N>
struct Fp8MmaSS {
  static constexpr auto select() {
    if constexpr (N == 8)
      return gmma::MMA_64x8x32_F32E4M3E4M3_SS_TN<>{};
    else if constexpr (N == 16)
      return gmma::MMA_64x16x32_F32E4M3E4M3_SS_TN<>{};
    else if constexpr (N == 32)
      return gmma::MMA_64x32x32_F32E4M3E4M3_SS_TN<>{};
    else if constexpr (N == 64)
      return gmma::MMA_64x64x32_F32E4M3E4M3_SS_TN<>{};
  }
  using Atom = decltype(select());
  static_assert(!std::is_void_v<Atom>, "Fp8MmaSS: shape not in the selector");
  __device__ __forceinline__ static void wgmma(uint64_t da, uint64_t db, float* d, bool scale_d) {
    wgmma_ss<Atom>(da, db, d, scale_d, std::make_index_sequence<N / 2>{});
  }
};

// BF16 x BF16, K = 16, A K-major; B K-major or MN-major.
template <int N, Major kMajorB = Major::K>
struct Bf16MmaSS {
  static constexpr auto select() {
    if constexpr (N == 8)
      return gmma::MMA_64x8x16_F32BF16BF16_SS<Major::K, kMajorB>{};
    else if constexpr (N == 16)
      return gmma::MMA_64x16x16_F32BF16BF16_SS<Major::K, kMajorB>{};
    else if constexpr (N == 32)
      return gmma::MMA_64x32x16_F32BF16BF16_SS<Major::K, kMajorB>{};
    else if constexpr (N == 64)
      return gmma::MMA_64x64x16_F32BF16BF16_SS<Major::K, kMajorB>{};
    else if constexpr (N == 256)
      return gmma::MMA_64x256x16_F32BF16BF16_SS<Major::K, kMajorB>{};
  }
  using Atom = decltype(select());
  static_assert(!std::is_void_v<Atom>, "Bf16MmaSS: shape not in the selector");
  __device__ __forceinline__ static void wgmma(uint64_t da, uint64_t db, float* d, bool scale_d) {
    wgmma_ss<Atom>(da, db, d, scale_d, std::make_index_sequence<N / 2>{});
  }
};

// BF16 x BF16, K = 16, A from registers (a[0..3]: the m64k16 fragment), B K-major or MN-major.
template <int N, Major kMajorB = Major::K>
struct Bf16MmaRS {
  static constexpr auto select() {
    if constexpr (N == 8)
      return gmma::MMA_64x8x16_F32BF16BF16_RS<Major::K, kMajorB>{};
    else if constexpr (N == 16)
      return gmma::MMA_64x16x16_F32BF16BF16_RS<Major::K, kMajorB>{};
    else if constexpr (N == 32)
      return gmma::MMA_64x32x16_F32BF16BF16_RS<Major::K, kMajorB>{};
    else if constexpr (N == 48)
      return gmma::MMA_64x48x16_F32BF16BF16_RS<Major::K, kMajorB>{};
    else if constexpr (N == 64)
      return gmma::MMA_64x64x16_F32BF16BF16_RS<Major::K, kMajorB>{};
    else if constexpr (N == 96)
      return gmma::MMA_64x96x16_F32BF16BF16_RS<Major::K, kMajorB>{};
    else if constexpr (N == 128)
      return gmma::MMA_64x128x16_F32BF16BF16_RS<Major::K, kMajorB>{};
    else if constexpr (N == 192)
      return gmma::MMA_64x192x16_F32BF16BF16_RS<Major::K, kMajorB>{};
    else if constexpr (N == 256)
      return gmma::MMA_64x256x16_F32BF16BF16_RS<Major::K, kMajorB>{};
  }
  using Atom = decltype(select());
  static_assert(!std::is_void_v<Atom>, "Bf16MmaRS: shape not in the selector");
  __device__ __forceinline__ static void wgmma(const uint32_t* a, uint64_t db, float* d,
                                               bool scale_d) {
    wgmma_rs<Atom>(a, db, d, scale_d, std::make_index_sequence<N / 2>{});
  }
};

}  // namespace dsv4::cuda::sm90
