// Sparse attention, Hopper kernel for head tiles of 64 (n_heads a multiple of 64: V4-Flash 64,
// V4-Pro 128): one CTA per (query token, 64 heads, key split), three warpgroups —
//   WG2 (producer): gathers each 64-key block's 584-byte entries straight from global memory
//       (window ring / staged batch entries / compressed store), decodes e4m3 x UE8M0 to BF16
//       exactly with integer bit moves and one BF16 multiply per pair (no cvt instructions:
//       the conversion cost that holds FlashMLA to ~25-30% of the ceilings at 64 heads), and
//       writes the 128-byte-swizzled K tile; two K buffers in flight;
//   WG0: S = Q K^T (wgmma 64x64x16, Q and K from smem), the block's online softmax exactly as
//       cpu::sparse_attention (running max, P rounded to BF16 against it, sum of the unrounded
//       exponentials), P to smem for WG1, and O[:, 0:256] += P V (wgmma 64x256x16, P from
//       registers, V = the same K tile read MN-major);
//   WG1: O[:, 256:512] += P V (P from smem).
// Splits write unnormalised partials for sparse_attention_combine.cu; one split applies the
// sink and writes BF16 directly.
#include <cuda_bf16.h>

#include <cmath>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/sparse_attention/sparse_attention_internal.h"

#if defined(DSV4_HAVE_CUTLASS)

#include "ops/cuda/common/sm90/bf16x2.cuh"
#include "ops/cuda/common/sm90/smem.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/common/sm90/wgmma.cuh"
#include "ops/cuda/sparse_attention/decode.cuh"
#include "ops/cuda/sparse_attention/key_source.cuh"
#include "ops/cuda/sparse_attention/sparse_attention_config.h"

namespace dsv4::cuda::sparse_attn_detail {
namespace {

using namespace sparse_attn_cfg;
using namespace detail;
using C = WgmmaCfg;

struct alignas(1024) WgSmem {
  uint8_t q[C::kTileBytes];
  uint8_t k[C::kKBufs][C::kTileBytes];
  uint8_t p[sm90::kSw128RegionBytes];
  float alpha[C::kHeads];
  float fin[C::kHeads];
  uint8_t valid[C::kKBufs][kKeyBlock];
};

// Named barrier ids.
enum : int { kBarFull = 1, kBarEmpty = 3, kBarPReady = 5, kBarPFree = 6, kBarEpi = 7 };
constexpr int kAll = C::kThreads, kPair = 256;

// Producer: one key row (half the 512 dims) of a block into the swizzled K tile.
// Thread (key, half): half 0 converts NoPE dims 0-255, half 1 NoPE 256-447 and copies the
// RoPE dims 448-511.
__device__ __forceinline__ void produce_row(uint8_t* tile, int key, int half, const uint8_t* src,
                                            const uint8_t* srcs) {
  if (src == nullptr) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int ch = 0; ch < 8; ++ch)
        *reinterpret_cast<uint4*>(tile +
                                  sm90::sw128_bf16_offset(key, 64 * (4 * half + r) + 8 * ch)) =
            make_uint4(0, 0, 0, 0);
    return;
  }
  const uint2 sc = __ldg(reinterpret_cast<const uint2*>(srcs));
  const uint64_t scales = (uint64_t(sc.y) << 32) | sc.x;  // byte b = UE8M0 of NoPE block b
  // Two regions (64 dims each) per pass keep at most 8 x 16 B of loads in registers.
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int r0 = 4 * half + 2 * pass;  // first region of the pass
    if (r0 == 6) {  // region 6 (NoPE 384-447) and region 7 (RoPE, already BF16)
      uint4 w[4], rope[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = __ldg(reinterpret_cast<const uint4*>(src + 384 + 16 * i));
#pragma unroll
      for (int i = 0; i < 8; ++i)
        rope[i] = __ldg(reinterpret_cast<const uint4*>(src + kNopeDim + 16 * i));
      const uint32_t s2 = bf16x2_pow2(int((scales >> 48) & 0xff) - 7);  // scale of block 6
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint4 lo, hi;
        e4m3x4_to_bf16x4(w[i].x, s2, lo.x, lo.y);
        e4m3x4_to_bf16x4(w[i].y, s2, lo.z, lo.w);
        e4m3x4_to_bf16x4(w[i].z, s2, hi.x, hi.y);
        e4m3x4_to_bf16x4(w[i].w, s2, hi.z, hi.w);
        *reinterpret_cast<uint4*>(tile + sm90::sw128_bf16_offset(key, 384 + 16 * i)) = lo;
        *reinterpret_cast<uint4*>(tile + sm90::sw128_bf16_offset(key, 384 + 16 * i + 8)) = hi;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
        *reinterpret_cast<uint4*>(tile + sm90::sw128_bf16_offset(key, kNopeDim + 8 * i)) = rope[i];
    } else {
      uint4 w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        w[i] = __ldg(reinterpret_cast<const uint4*>(src + 64 * r0 + 16 * i));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int blk = r0 + (i >> 2);  // 64-value scale block = region
        const uint32_t s2 = bf16x2_pow2(int((scales >> (8 * blk)) & 0xff) - 7);
        const int d = 64 * r0 + 16 * i;
        uint4 lo, hi;
        e4m3x4_to_bf16x4(w[i].x, s2, lo.x, lo.y);
        e4m3x4_to_bf16x4(w[i].y, s2, lo.z, lo.w);
        e4m3x4_to_bf16x4(w[i].z, s2, hi.x, hi.y);
        e4m3x4_to_bf16x4(w[i].w, s2, hi.z, hi.w);
        *reinterpret_cast<uint4*>(tile + sm90::sw128_bf16_offset(key, d)) = lo;
        *reinterpret_cast<uint4*>(tile + sm90::sw128_bf16_offset(key, d + 8)) = hi;
      }
    }
  }
}

__global__ void __launch_bounds__(C::kThreads, 1) sparse_attn_wgmma_kernel(const AttnArgs a) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  WgSmem& sm =
      *reinterpret_cast<WgSmem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int t = blockIdx.x / a.head_tiles;
  const int h0 = (blockIdx.x % a.head_tiles) * C::kHeads;
  const int split = blockIdx.y;
  const QueryInfo qi = query_info(a, t);
  const int nblk = (qi.nkeys + kKeyBlock - 1) / kKeyBlock;
  const int blk_begin = split * a.blocks_per_split;
  const int blk_end = min(nblk, blk_begin + a.blocks_per_split);
  const int nb = blk_end - blk_begin;
  const int tid = threadIdx.x, wgi = tid / 128, wt = tid % 128;

  if (nb <= 0) {  // an empty split: m = -inf marks it for the combine
    if (tid < C::kHeads) {
      float* part = a.partials +
                    ((int64_t(t) * a.n_heads + h0 + tid) * a.num_splits + split) * kPartialFloats;
      part[kHeadDim] = -INFINITY;
      part[kHeadDim + 1] = 0.0f;
    }
    return;
  }

  if (wgi == 2) {
    // ---------------------------------------------------------------- producer
    sm90::warpgroup_reg_dealloc<C::kRegsProducer>();
    // Q tile: thread -> head row wt / 2, half of the dims.
    {
      const int row = wt >> 1, half = wt & 1;
      const uint4* src = reinterpret_cast<const uint4*>(
          a.q + (int64_t(t) * a.n_heads + h0 + row) * kHeadDim + 256 * half);
#pragma unroll 4
      for (int i = 0; i < 32; ++i)
        *reinterpret_cast<uint4*>(sm.q + sm90::sw128_bf16_offset(row, 256 * half + 8 * i)) =
            __ldg(src + i);
    }
    const int key = wt >> 1, half = wt & 1;
    for (int i = 0; i < nb; ++i) {
      const int b = i & 1;
      if (i >= C::kKBufs) sm90::named_barrier_sync(kBarEmpty + b, kAll);
      const int slot = (blk_begin + i) * kKeyBlock + key;
      const uint8_t* src = nullptr;
      const uint8_t* srcs = nullptr;
      if (!(slot < qi.nkeys && key_source(a, qi, slot, src, srcs))) src = nullptr;
      produce_row(sm.k[b], key, half, src, srcs);
      if (half == 0) sm.valid[b][key] = src != nullptr;
      sm90::fence_proxy_async_smem();
      sm90::named_barrier_arrive(kBarFull + b, kAll);
    }
    return;
  }

  const int w4 = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int r0 = 16 * w4 + g;  // this thread's rows r0, r0 + 8 (heads h0 + row)
  const uint32_t q_addr = sm90::smem_u32(sm.q), p_addr = sm90::smem_u32(sm.p);
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;

  if (wgi == 0) {
    // ---------------------------------------------------------------- S, softmax, P V (dims 0-255)
    sm90::warpgroup_reg_alloc<C::kRegsWg0>();
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
    for (int i = 0; i < nb; ++i) {
      const int b = i & 1;
      const uint32_t k_addr = sm90::smem_u32(sm.k[b]);
      sm90::named_barrier_sync(kBarFull + b, kAll);
      float s[32];
      sm90::warpgroup_fence_operands(s);
      sm90::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        sm90::Bf16MmaSS<64>::wgmma(sm90::desc_region_kmajor(q_addr, ks),
                                   sm90::desc_region_kmajor(k_addr, ks), s, ks > 0);
      sm90::warpgroup_commit_batch();
      sm90::warpgroup_wait<0>();
      sm90::warpgroup_fence_operands(s);

      // Scores of keys 8j + 2c + e, rows r0 (s[4j + e]) and r0 + 8 (s[4j + 2 + e]).
      float bmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool v0 = sm.valid[b][8 * j + 2 * c] != 0, v1 = sm.valid[b][8 * j + 2 * c + 1] != 0;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          s[4 * j + 2 * r] = v0 ? s[4 * j + 2 * r] * a.scale_log2 : -INFINITY;
          s[4 * j + 2 * r + 1] = v1 ? s[4 * j + 2 * r + 1] * a.scale_log2 : -INFINITY;
          bmax[r] = fmaxf(bmax[r], fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        }
      }
      float alpha[2], mm[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        bmax[r] = fmaxf(bmax[r], __shfl_xor_sync(0xffffffffu, bmax[r], 1));
        bmax[r] = fmaxf(bmax[r], __shfl_xor_sync(0xffffffffu, bmax[r], 2));
        const float m_new = fmaxf(m_r[r], bmax[r]);
        alpha[r] = m_new == -INFINITY ? 1.0f : exp2f(m_r[r] - m_new);
        m_r[r] = m_new;
        mm[r] = m_new == -INFINITY ? 0.0f : m_new;
      }
      uint32_t pp[16];  // BF16 pairs: (tile j, row r) -> pp[2j + r]
      float bsum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float p0 = exp2f(s[4 * j + 2 * r] - mm[r]),
                      p1 = exp2f(s[4 * j + 2 * r + 1] - mm[r]);
          bsum[r] += p0 + p1;
          pp[2 * j + r] = sm90::pack_bf16x2(p0, p1);
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        bsum[r] += __shfl_xor_sync(0xffffffffu, bsum[r], 1);
        bsum[r] += __shfl_xor_sync(0xffffffffu, bsum[r], 2);
        l_r[r] = l_r[r] * alpha[r] + bsum[r];
      }
      // Hand P and the rescale factors to WG1 once it is done with the previous block's.
      sm90::named_barrier_sync(kBarPFree, kPair);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = r0 + 8 * r;
          *reinterpret_cast<uint32_t*>(sm.p + row * 128 + ((j ^ (row & 7)) << 4) + 4 * c) =
              pp[2 * j + r];
        }
      if (c == 0) {
        sm.alpha[r0] = alpha[0];
        sm.alpha[r0 + 8] = alpha[1];
      }
      sm90::fence_proxy_async_smem();
      sm90::named_barrier_arrive(kBarPReady, kPair);

#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
      sm90::warpgroup_fence_operands(o);
      sm90::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t af[4] = {pp[4 * kk], pp[4 * kk + 1], pp[4 * kk + 2], pp[4 * kk + 3]};
        sm90::Bf16MmaRS<256, sm90::Major::MN>::wgmma(af, sm90::desc_region_mnmajor(k_addr, 0, kk),
                                                     o, true);
      }
      sm90::warpgroup_commit_batch();
      sm90::warpgroup_wait<0>();
      sm90::warpgroup_fence_operands(o);
      if (i + C::kKBufs < nb) sm90::named_barrier_arrive(kBarEmpty + b, kAll);
    }
    // Per-row output factor for both consumer warpgroups.
    if (c == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = r0 + 8 * r;
        float fin = 1.0f;
        if (a.num_splits == 1) {
          fin = 0.0f;  // no valid key: the reference's acc / inf = 0
          if (m_r[r] != -INFINITY)
            fin = 1.0f / (l_r[r] + exp2f(__ldg(a.sink + h0 + row) * 1.4426950408889634f - m_r[r]));
        } else {
          float* part = a.partials + ((int64_t(t) * a.n_heads + h0 + row) * a.num_splits + split) *
                                         kPartialFloats;
          part[kHeadDim] = m_r[r];
          part[kHeadDim + 1] = l_r[r];
        }
        sm.fin[row] = fin;
      }
    }
    __syncwarp();  // sm.fin of this warp's rows (written by lane c == 0 of each quad)
    sm90::named_barrier_arrive(kBarEpi, kPair);
  } else {
    // ---------------------------------------------------------------- P V (dims 256-511)
    // (keeps the launch allocation of C::kRegsWg1 registers)
    sm90::named_barrier_arrive(kBarPFree, kPair);
    for (int i = 0; i < nb; ++i) {
      const int b = i & 1;
      const uint32_t k_addr = sm90::smem_u32(sm.k[b]);
      sm90::named_barrier_sync(kBarFull + b, kAll);
      sm90::named_barrier_sync(kBarPReady, kPair);
      const float al0 = sm.alpha[r0], al1 = sm.alpha[r0 + 8];
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j] *= al0;
        o[4 * j + 1] *= al0;
        o[4 * j + 2] *= al1;
        o[4 * j + 3] *= al1;
      }
      sm90::warpgroup_fence_operands(o);
      sm90::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        sm90::Bf16MmaSS<256, sm90::Major::MN>::wgmma(sm90::desc_region_kmajor(p_addr, kk),
                                                     sm90::desc_region_mnmajor(k_addr, 4, kk), o,
                                                     true);
      sm90::warpgroup_commit_batch();
      sm90::warpgroup_wait<0>();
      sm90::warpgroup_fence_operands(o);
      if (i + 1 < nb) sm90::named_barrier_arrive(kBarPFree, kPair);
      if (i + C::kKBufs < nb) sm90::named_barrier_arrive(kBarEmpty + b, kAll);
    }
    sm90::named_barrier_sync(kBarEpi, kPair);
  }

  // Epilogue: rows r0, r0 + 8; this warpgroup's 256 dims, column 8j + 2c (+1).
  const int d0 = 256 * wgi;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + 8 * r;
    const float fin = sm.fin[row];
    if (a.num_splits == 1) {
      __nv_bfloat16* orow = a.out + (int64_t(t) * a.n_heads + h0 + row) * kHeadDim + d0 + 2 * c;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<uint32_t*>(orow + 8 * j) =
            sm90::pack_bf16x2(o[4 * j + 2 * r] * fin, o[4 * j + 2 * r + 1] * fin);
    } else {
      float* part = a.partials +
                    ((int64_t(t) * a.n_heads + h0 + row) * a.num_splits + split) * kPartialFloats +
                    d0 + 2 * c;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(part + 8 * j) =
            make_float2(o[4 * j + 2 * r], o[4 * j + 2 * r + 1]);
    }
  }
}

}  // namespace

size_t wgmma_smem_bytes() {
  return sizeof(WgSmem) + 1024;
}

void launch_wgmma(const AttnArgs& a, cudaStream_t stream) {
  const size_t smem = wgmma_smem_bytes();
  static std::atomic<uint64_t> attr{0};
  once_per_device(attr, [&] {
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(sparse_attn_wgmma_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  });
  const dim3 grid(unsigned(int64_t(a.num_tokens) * a.head_tiles), unsigned(a.num_splits));
  sparse_attn_wgmma_kernel<<<grid, C::kThreads, smem, stream>>>(a);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

bool wgmma_available() {
  return true;
}

}  // namespace dsv4::cuda::sparse_attn_detail

#else  // !DSV4_HAVE_CUTLASS

namespace dsv4::cuda::sparse_attn_detail {
size_t wgmma_smem_bytes() {
  return 0;
}
void launch_wgmma(const AttnArgs&, cudaStream_t) {
  DSV4_CHECK(false, "sparse_attention: the wgmma kernel needs the CUTLASS/CuTe headers");
}
bool wgmma_available() {
  return false;
}
}  // namespace dsv4::cuda::sparse_attn_detail

#endif
