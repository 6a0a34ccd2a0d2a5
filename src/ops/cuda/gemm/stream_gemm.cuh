// The weight-streaming GEMM for decode-sized M (1..256 rows of activations), y = x W^T with W
// [n, K] row-major, for two operand kinds:
//   kFp8 = true : e4m3 codes, activations per-(row,128) scaled, weights per-128x128 scaled; the
//                 128-wide K blocks are promoted into the fp32 accumulator with sa * sw (the
//                 reference's fp8_gemm), each block as four exact 32-wide wgmma partials; BF16 out.
//   kFp8 = false: BF16 x BF16 with fp32 accumulation; fp32 out (the head's logits).
//
// Swap-AB: the weight tile is the wgmma M side (two m64 tiles = 128 weight rows per CTA) and the
// tokens are the wgmma N side (padded to kMT = 8/16/32/64 by the TMA's zero fill), so the tensor
// cores are never the limit and every CTA only streams weights. Above 64 tokens, blocks of 64
// are separate CTAs (token_blocks of them per weight tile, adjacent in blockIdx.x so that they
// run together and the later ones read the tile from L2); each computes exactly what a launch of
// its 64 tokens alone would. Warp roles: warps 0-3 form the
// consumer warpgroup (wgmma + promotion), warp 4 issues TMA loads into a kStages-deep ring of
// shared-memory stages (one stage = 128 bytes of K for 128 weight rows + kMT token rows).
// K is split across the CTAs of a cluster (gridDim.y = cluster size = splits); their fp32
// partial tiles are summed in rank order through distributed shared memory, so results are
// deterministic and no global workspace is needed. Every rank sums an equal share of the tile's
// elements, all ranks' partials of an element loaded before they are added (the loads overlap).
// Grouped launch: up to kStreamMaxGroups weight matrices with the same K, multiplied by the same
// activations into separate outputs; gridDim.x runs over the tiles of every weight in turn.
// A CTA computes exactly what it would in a launch of its weight alone with the same split
// count (same tile, same K range, same order of operations), so each output is bit-identical
// to the separate GEMM at that split.
// Programmatic dependent launch: the producer warp streams weights before griddepcontrol.wait
// (they do not depend on the previous kernel); every CTA lets the next kernel launch once its
// main loop is done (that kernel's griddepcontrol.wait still waits for this grid's completion).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "ops/cuda/common/sm90/mbarrier.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/common/sm90/tma.cuh"
#include "ops/cuda/common/sm90/wgmma.cuh"
#include "ops/cuda/gemm/fp8_gemm_config.h"
#include "ops/cuda/gemm/stream_gemm_layout.h"

namespace dsv4::cuda::stream_gemm {

namespace cg = cooperative_groups;
// d[kN/2] (+)= A(64 x 32 bytes of K) * B(kN x 32 bytes of K)^T, both from 128B-swizzled smem.
template <bool kFp8, int kN>
__device__ __forceinline__ void mma_step(uint64_t da, uint64_t db, float* d, bool scale_d) {
  if constexpr (kFp8)
    sm90::Fp8MmaSS<kN>::wgmma(da, db, d, scale_d);
  else
    sm90::Bf16MmaSS<kN>::wgmma(da, db, d, scale_d);
}

// wgmma.wait_group with a count known only once the caller's loop is unrolled.
__device__ __forceinline__ void wait_pending(int n) {
  switch (n) {
    case 0:
      return sm90::warpgroup_wait<0>();
    case 1:
      return sm90::warpgroup_wait<1>();
    case 2:
      return sm90::warpgroup_wait<2>();
    default:
      return sm90::warpgroup_wait<3>();
  }
}

// One weight matrix of a (grouped) launch.
struct Group {
  int n = 0;                          // weight rows
  int tile0 = 0;                      // its first tile (blockIdx.x)
  const float* w_scales_t = nullptr;  // fp8: [k/128, w_scale_ld] fp32
  int w_scale_ld = 0;
  void* out = nullptr;  // [m, ldo]: BF16 (fp8) or fp32 (bf16)
  int64_t ldo = 0;
};

struct Args {
  int m = 0;             // tokens (<= kMT * token_blocks)
  int token_blocks = 1;  // ceil(m / kMT): CTAs per weight tile and K range
  int k_steps = 0;       // 128-byte K steps per weight row
  int groups = 1;        // 1..kStreamMaxGroups
  Group g[gemm_cfg::kStreamMaxGroups];
};

// The weights' tensor maps, one per group (only the first `groups` are set).
struct WeightMaps {
  CUtensorMap m[gemm_cfg::kStreamMaxGroups];
};

template <int kMT, bool kFp8, int kStages>
__global__ void __launch_bounds__(gemm_cfg::kStreamThreads, 1)
    stream_gemm_kernel(const __grid_constant__ WeightMaps tm_ws,
                       const __grid_constant__ CUtensorMap tm_a,
                       const __grid_constant__ CUtensorMap tm_sa, const Args args) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kRows = gemm_cfg::kStreamRows;
  constexpr int kStepBytes = gemm_cfg::kStreamStepBytes;
  constexpr int kStepElems = kFp8 ? kStepBytes : kStepBytes / 2;
  constexpr int kWBytes = kRows * kStepBytes;
  constexpr int kABytes = kMT * kStepBytes;
  constexpr int kSABytes = kFp8 ? gemm_cfg::align_up(kMT * 4, 128) : 0;
  constexpr int kTxBytes = kWBytes + kABytes + (kFp8 ? kMT * 4 : 0);
  constexpr int kAcc = kMT / 2;  // accumulator registers per m64 tile
  constexpr int kBatch = gemm_cfg::stream_slice_batch(kMT);

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* s_w = smem;
  uint8_t* s_a = s_w + kStages * kWBytes;
  float* s_sa = reinterpret_cast<float*>(s_a + kStages * kABytes);
  uint64_t* full =
      reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(s_sa) + kStages * kSABytes);
  uint64_t* empty = full + kStages;

  // This CTA's tile (over every group) and block of tokens.
  const int token_block = int(blockIdx.x) % args.token_blocks;
  const int gtile = int(blockIdx.x) / args.token_blocks;
  const int tok0 = token_block * kMT;
  // Its weight: the last group whose first tile is at or before gtile (selected with constant
  // indices, so the parameters stay in the constant bank).
  const CUtensorMap* tm_w = &tm_ws.m[0];
  Group grp = args.g[0];
#pragma unroll
  for (int i = 1; i < gemm_cfg::kStreamMaxGroups; ++i)
    if (i < args.groups && gtile >= args.g[i].tile0) {
      tm_w = &tm_ws.m[i];
      grp = args.g[i];
    }
  const int tile = gtile - grp.tile0;
  // A tile that several token blocks read stays in L2 for the others (normal eviction).
  const uint64_t w_hint = args.token_blocks > 1 ? sm90::kEvictNormal : sm90::kEvictFirst;
  const int splits = gridDim.y;
  const int split = blockIdx.y;  // == rank in the cluster (cluster dims (1, splits, 1))
  const int n0 = tile * kRows;
  const int s_begin = int((long long)split * args.k_steps / splits);
  const int s_end = int((long long)(split + 1) * args.k_steps / splits);
  const int count = s_end - s_begin;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(&full[s], 1);
      sm90::mbar_init(&empty[s], 4);  // one arrival per consumer warp
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  float acc[2][kAcc];
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[t][i] = 0.0f;

  if (warp == 4) {
    // ---- producer ----
    if (lane == 0) {
      sm90::prefetch_tensormap(tm_w);
      sm90::prefetch_tensormap(&tm_a);
      if constexpr (kFp8) sm90::prefetch_tensormap(&tm_sa);
      // Weights do not depend on the previous kernel: fill the ring with them first, then wait
      // for the activations (programmatic dependent launch) and complete the stages.
      const int pre = count < kStages ? count : kStages;
      for (int i = 0; i < pre; ++i) {
        sm90::mbar_arrive_expect_tx(&full[i], kTxBytes);
        sm90::tma_load_2d(tm_w, &full[i], s_w + i * kWBytes, (s_begin + i) * kStepElems, n0,
                          w_hint);
      }
      sm90::griddep_wait();
      for (int i = 0; i < pre; ++i) {
        sm90::tma_load_2d(&tm_a, &full[i], s_a + i * kABytes, (s_begin + i) * kStepElems, tok0,
                          sm90::kEvictLast);
        if constexpr (kFp8)
          sm90::tma_load_2d(&tm_sa, &full[i], reinterpret_cast<uint8_t*>(s_sa) + i * kSABytes, tok0,
                            s_begin + i, sm90::kEvictLast);
      }
      for (int i = pre; i < count; ++i) {
        const int s = i % kStages;
        sm90::mbar_wait(&empty[s], ((i / kStages) - 1) & 1);
        sm90::mbar_arrive_expect_tx(&full[s], kTxBytes);
        const int kc = (s_begin + i) * kStepElems;
        sm90::tma_load_2d(tm_w, &full[s], s_w + s * kWBytes, kc, n0, w_hint);
        sm90::tma_load_2d(&tm_a, &full[s], s_a + s * kABytes, kc, tok0, sm90::kEvictLast);
        if constexpr (kFp8)
          sm90::tma_load_2d(&tm_sa, &full[s], reinterpret_cast<uint8_t*>(s_sa) + s * kSABytes, tok0,
                            s_begin + i, sm90::kEvictLast);
      }
    }
    __syncwarp();  // reconverge before the block-wide barriers of the epilogue
  } else {
    // ---- consumer warpgroup ----
    sm90::griddep_wait();
    const int q0 = (lane & 3) * 2;  // this thread's token pair inside each group of 8
    // The slices' own accumulators: every wgmma into them overwrites (scale_d = false), so they
    // are zeroed once here, not before every slice.
    [[maybe_unused]] float part[kFp8 ? kBatch : 1][2][kFp8 ? kAcc : 1];
#pragma unroll
    for (int b = 0; b < (kFp8 ? kBatch : 1); ++b)
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int j = 0; j < (kFp8 ? kAcc : 1); ++j) part[b][t][j] = 0.0f;
    float sw_next = 0.0f;
    if constexpr (kFp8)
      if (count > 0) sw_next = __ldg(grp.w_scales_t + size_t(s_begin) * grp.w_scale_ld + tile);
    for (int i = 0; i < count; ++i) {
      const int s = i % kStages;
      sm90::mbar_wait(&full[s], (i / kStages) & 1);
      const uint64_t dw = sm90::desc_k_sw128(sm90::smem_u32(s_w + s * kWBytes));
      const uint64_t da = sm90::desc_k_sw128(sm90::smem_u32(s_a + s * kABytes));
      if constexpr (kFp8) {
        const float sw = sw_next;
        if (i + 1 < count)
          sw_next = __ldg(grp.w_scales_t + size_t(s_begin + i + 1) * grp.w_scale_ld + tile);
        // Per-token activation scales of this step, times the weight block's scale.
        const float* sa =
            reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(s_sa) + s * kSABytes);
        float2 scl[kMT / 8];
#pragma unroll
        for (int g = 0; g < kMT / 8; ++g) {
          const float2 v = *reinterpret_cast<const float2*>(sa + g * 8 + q0);
          scl[g] = make_float2(v.x * sw, v.y * sw);
        }
        // Every 32-wide K slice is its own wgmma accumulation, promoted into fp32 at once: the
        // FP8 tensor cores accumulate into C with ~14 significant bits, so chaining the four
        // slices of a 128 block inside the tensor core would cost ~1e-4 relative accuracy that
        // the memory-bound decode can afford to keep (the products of one slice are exact).
        // kBatch slices are issued together, each into its own accumulator and as its own
        // commit group, and promoted in slice order as each retires (the later slices' wgmmas
        // run meanwhile): the same operations as one slice per wait, fewer round trips. Unrolled
        // where several slices are in flight, so that every wait has its count and ptxas sees which
        // slice has retired (C7514 otherwise); 64 tokens keep one slice per wait (two would not
        // leave two CTAs an SM; split into 32-token halves to overlap, it measured slower on the
        // H200).
#pragma unroll(kBatch == 1 ? 1 : 4)
        for (int kb = 0; kb < 4; kb += kBatch) {
#pragma unroll
          for (int b = 0; b < kBatch; ++b)
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
              for (int j = 0; j < kAcc; ++j) sm90::warpgroup_fence_operand(part[b][t][j]);
          sm90::warpgroup_arrive();
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
#pragma unroll
            for (int t = 0; t < 2; ++t)
              mma_step<true, kMT>(dw + ((t * 64 * kStepBytes + (kb + b) * 32) >> 4),
                                  da + (((kb + b) * 32) >> 4), part[b][t], false);
            sm90::warpgroup_commit_batch();
          }
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            wait_pending(kBatch - 1 - b);
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
              for (int j = 0; j < kAcc; ++j) {
                sm90::warpgroup_fence_operand(part[b][t][j]);
                acc[t][j] = fmaf(part[b][t][j], (j & 1) ? scl[j >> 2].y : scl[j >> 2].x, acc[t][j]);
              }
          }
        }
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(&empty[s]);
      } else {
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int j = 0; j < kAcc; ++j) sm90::warpgroup_fence_operand(acc[t][j]);
        sm90::warpgroup_arrive();
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            mma_step<false, kMT>(dw + ((t * 64 * kStepBytes + kk * 32) >> 4), da + ((kk * 32) >> 4),
                                 acc[t], true);
        sm90::warpgroup_commit_batch();
        sm90::warpgroup_wait<0>();
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int j = 0; j < kAcc; ++j) sm90::warpgroup_fence_operand(acc[t][j]);
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(&empty[s]);
      }
    }
  }

  // The next kernel may launch now (it waits for this grid's completion before reading y).
  sm90::griddep_launch_dependents();
  // ---- epilogue: partial tile in register order into the (now idle) stage buffers ----
  // Every consumer warp has finished reading the stages before any of them is overwritten.
  if (warp < 4) sm90::named_barrier_sync(1, gemm_cfg::kStreamConsumerThreads);
  float* part_tile = reinterpret_cast<float*>(smem);
  if (warp < 4) {
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int j = 0; j < kAcc; ++j) part_tile[acc_store_index<kMT>(t, j, threadIdx.x)] = acc[t][j];
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (splits > 1)
    sm90::cluster_sync();
  else
    __syncthreads();
  // The block's elements (token-major: e = col * 128 + row, consecutive threads on consecutive
  // n) are shared out over the ranks, rank r taking [r*E/splits, (r+1)*E/splits). Each is the
  // sum, in rank order from 0.0f, of the cluster's partial tiles: every rank's partial is
  // loaded first (independent remote loads in flight together), then added in order.
  if (warp < 4) {
    const int m_blk = min(kMT, args.m - tok0);
    const int total = m_blk * kRows;
    const int e0 = int((long long)split * total / splits);
    const int e1 = int((long long)(split + 1) * total / splits);
    for (int e = e0 + int(threadIdx.x); e < e1; e += gemm_cfg::kStreamConsumerThreads) {
      const int col = e / kRows, row = e % kRows;
      const int idx = partial_index<kMT>(row, col);
      float v = 0.0f;
      if (splits == 1) {
        v += part_tile[idx];
      } else {
        float p[gemm_cfg::kStreamMaxSplits];
#pragma unroll
        for (int r = 0; r < gemm_cfg::kStreamMaxSplits; ++r)
          if (r < splits) p[r] = cluster.map_shared_rank(part_tile, r)[idx];
#pragma unroll
        for (int r = 0; r < gemm_cfg::kStreamMaxSplits; ++r)
          if (r < splits) v += p[r];
      }
      if (n0 + row < grp.n) {
        const size_t o = size_t(tok0 + col) * grp.ldo + n0 + row;
        if constexpr (kFp8)
          reinterpret_cast<__nv_bfloat16*>(grp.out)[o] = __float2bfloat16_rn(v);
        else
          reinterpret_cast<float*>(grp.out)[o] = v;
      }
    }
  }
  // No CTA may leave while a peer still reads its shared memory.
  if (splits > 1) sm90::cluster_sync();
#endif
}

}  // namespace dsv4::cuda::stream_gemm
