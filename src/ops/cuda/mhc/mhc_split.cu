// Split-K decode path of mHC (mhc_split.h). Projection kernel, then the finishing kernel, both
// launched with programmatic stream serialisation: each reads what its predecessor wrote only
// after griddep_wait, and lets its successor launch at once.
#include "ops/cuda/mhc/mhc_split.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/common/sm90/cp_async.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/common/sm90/warp_mma.cuh"
#include "ops/cuda/gemm/act_quant.cuh"
#include "ops/cuda/mhc/mhc_config.h"
#include "ops/cuda/mhc/mhc_math.cuh"

namespace dsv4::cuda::mhc_split {
namespace {

using namespace mhc_cfg;
using namespace mhc_math;

struct ProjArgs {
  int tokens = 0, dim = 0, splits = 0, chunks_per_split = 0;
  const __nv_bfloat16* streams = nullptr;
  const __nv_bfloat16* x_prev = nullptr;
  const __nv_bfloat16* res = nullptr;
  const float* post_prev = nullptr;
  const float* comb_prev = nullptr;
  __nv_bfloat16* streams_out = nullptr;
  const float* fn = nullptr;
  float* part_mix = nullptr;  // [tokens, splits, mix]
  double* part_ss = nullptr;  // [tokens, splits]
};

struct FinishArgs {
  int dim = 0, splits = 0, iters = 20;
  float norm_eps = 1e-6f, hc_eps = 1e-6f;
  const __nv_bfloat16* streams = nullptr;  // what is collapsed (kPostPre: the new streams)
  const float* base = nullptr;
  const float* scale = nullptr;
  const __nv_bfloat16* norm_w = nullptr;
  float nrm_eps = 1e-6f;
  const float* part_mix = nullptr;
  const double* part_ss = nullptr;
  __nv_bfloat16* y = nullptr;
  float* post = nullptr;
  float* comb = nullptr;
  uint8_t* q_codes = nullptr;  // optional FP8 quantisation of y
  float* q_scales_t = nullptr;
  int q_ld_scales = 0;
};

template <Kind kKind>
constexpr int mix_of() {
  return kKind == Kind::kHead ? kMixHead : kMixPre;
}

// Plain (coherent) 16-byte global load: for data this grid or its predecessor writes (the
// streams of hc_post_pre may be written in place), where the read-only path is not allowed.
__device__ __forceinline__ uint4 ld16(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// ---- 1. projection -------------------------------------------------------------------------
// Thread (warp j, lane = 4g + tq) holds, per d-chunk, 8 consecutive dims d = 32 dc + 8 tq of stream
// j for token rows g and g + 8 of each m-tile (the A fragments, K permuted within the chunk the
// same way on both operands) and the 8 matching fn values of mix rows nt * 8 + g (B fragments).
//
// kStages > 0 (prefill sizes, kPre / kHead; stage_bytes()): the streams come through a ring of
// kStages shared-memory stages filled by cp.async kStages - 1 chunks ahead, each thread copying
// exactly the 16-byte pieces it later reads (so its own wait_group is the only synchronisation):
// 48 KB in flight a CTA (two CTAs an SM, by registers) where the register path held one chunk
// (8 KB) and ran at ~1.6 TB/s (8192 tokens, Flash: 168 us for 268 MB). The reduction buffers
// reuse the ring afterwards.
template <Kind kKind, int kMt>
struct ProjSmem {
  static constexpr int kRows = 16 * kMt;
  float red[kHc][kRows][mix_of<kKind>()];
  double red_ss[kHc][kRows];
};
template <int kMt>
constexpr int stage_bytes() {
  return kMt * 2 * kHc * 32 * 16;  // [mt][h][warp][lane] x 16 bytes
}
// Dynamic shared memory of a projection instance: the reduction buffers, overlaying the ring.
template <Kind kKind, int kMt, int kStages>
constexpr size_t proj_smem_bytes() {
  return std::max(size_t(kStages) * stage_bytes<kMt>(), sizeof(ProjSmem<kKind, kMt>));
}

template <Kind kKind, int kMt, int kStages>
__global__ void __launch_bounds__(kSplitProjThreads) hc_split_proj_kernel(const ProjArgs p) {
  constexpr int kMix = mix_of<kKind>();
  constexpr int kNt = (kMix + 7) / 8;
  constexpr int kRows = 16 * kMt;
  static_assert(kStages == 0 || (kKind != Kind::kPostPre && kStages >= 2), "staged: kPre, kHead");
  extern __shared__ __align__(16) uint8_t proj_dyn[];
  ProjSmem<kKind, kMt>& sm = *reinterpret_cast<ProjSmem<kKind, kMt>*>(proj_dyn);
  auto& red = sm.red;
  auto& red_ss = sm.red_ss;

  const int j = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int s = blockIdx.x;
  const int t0 = blockIdx.y * kRows;
  const int rows = min(kRows, p.tokens - t0);
  const int dc0 = s * p.chunks_per_split;
  const int dc1 = min(p.dim / kSplitDimUnit, dc0 + p.chunks_per_split);
  const int64_t n = int64_t(kHc) * p.dim;

  auto load_fn = [&](int dc, float4(&f)[kNt][2]) {
    const int64_t k = int64_t(j) * p.dim + dc * kSplitDimUnit + 8 * tq;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      const int r = nt * 8 + g;
      if (r < kMix) {
        const float4* src = reinterpret_cast<const float4*>(p.fn + int64_t(r) * n + k);
        f[nt][0] = __ldg(src);
        f[nt][1] = __ldg(src + 1);
      } else {
        f[nt][0] = f[nt][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  };
  // The weights are no predecessor's output: fetch the first chunk's before waiting on it.
  float4 fb[kNt][2];
  if (dc0 < dc1) load_fn(dc0, fb);
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();

  float acc[kMt][kNt][4];
  double ss[kMt][2];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
    ss[mt][0] = ss[mt][1] = 0.0;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
  }

  // kPre / kHead: the streams of the next d-chunk are loaded while this one is projected (a long
  // range per CTA at prefill would otherwise expose a memory latency per d-chunk).
  auto load_a = [&](int dc, uint4(&a)[kMt][2]) {
    const int d = dc * kSplitDimUnit + 8 * tq;
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mt * 16 + g + 8 * h;
        a[mt][h] = row < rows ? ld16(p.streams + int64_t(t0 + row) * n + int64_t(j) * p.dim + d)
                              : make_uint4(0, 0, 0, 0);
      }
  };
  uint4 anext[kMt][2];
  if constexpr (kKind != Kind::kPostPre && kStages == 0)
    if (dc0 < dc1) load_a(dc0, anext);
  // Staged: this thread's pieces of chunk dc into stage dc % kStages (rows past the tile: zeros).
  constexpr int kRing = kStages > 0 ? kStages : 1;
  uint4* ring = reinterpret_cast<uint4*>(proj_dyn);
  auto slot = [&](int stage, int mt, int h) -> uint4* {
    return ring + (((stage * kMt + mt) * 2 + h) * kHc + j) * 32 + lane;
  };
  auto stage_a = [&](int dc) {
    if (dc < dc1) {
      const int d = dc * kSplitDimUnit + 8 * tq;
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = mt * 16 + g + 8 * h;
          const bool in = row < rows;
          sm90::cp_async_16_zfill(
              slot(dc % kRing, mt, h),
              p.streams + (in ? int64_t(t0 + row) * n + int64_t(j) * p.dim + d : 0), in ? 16 : 0);
        }
    }
    sm90::cp_async_commit();  // one group per chunk, empty past the range: uniform counting
  };
  if constexpr (kStages > 0) {
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) stage_a(dc0 + st);
  }

  for (int dc = dc0; dc < dc1; ++dc) {  // uniform over the CTA (barrier inside for kPostPre)
    float4 fnext[kNt][2];
    const bool more = dc + 1 < dc1;
    if (more) load_fn(dc + 1, fnext);
    const int d = dc * kSplitDimUnit + 8 * tq;
    uint4 a[kMt][2];
    if constexpr (kStages > 0) {
      sm90::cp_async_wait<kStages - 2>();  // chunk dc has landed (this thread's own pieces)
      // Its stage was read last at chunk dc - 1 by this thread, into registers already used.
      stage_a(dc + kStages - 1);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) a[mt][h] = *slot(dc % kRing, mt, h);
    } else if constexpr (kKind != Kind::kPostPre) {
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) a[mt][0] = anext[mt][0], a[mt][1] = anext[mt][1];
      if (more) load_a(dc + 1, anext);
    } else {
      // out_j = bf16(post_j x + sum_i comb[i][j] res_i), the CPU's operations in its order.
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = mt * 16 + g + 8 * h;
          a[mt][h] = make_uint4(0, 0, 0, 0);
          if (row >= rows) continue;
          const int64_t t = t0 + row;
          float xv[8], rv[kHc][8], comb[kHc];
          unpack8(ld16(p.x_prev + t * p.dim + d), xv);
#pragma unroll
          for (int i = 0; i < kHc; ++i) {
            unpack8(ld16(p.res + t * n + int64_t(i) * p.dim + d), rv[i]);
            comb[i] = p.comb_prev[t * 16 + i * 4 + j];
          }
          const float post = p.post_prev[t * 4 + j];
          float o[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            float acc_o = fmul(comb[0], rv[0][e]);
#pragma unroll
            for (int i = 1; i < kHc; ++i) acc_o = fadd(acc_o, fmul(comb[i], rv[i][e]));
            o[e] = fadd(fmul(post, xv[e]), acc_o);
          }
          a[mt][h] = pack8(o);
        }
      // Every warp has read this chunk of res before any writes it (out may be res).
      __syncthreads();
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = mt * 16 + g + 8 * h;
          if (row < rows)
            *reinterpret_cast<uint4*>(p.streams_out + int64_t(t0 + row) * n + int64_t(j) * p.dim +
                                      d) = a[mt][h];
        }
    }
    // Sums of squares (fp64; squares of BF16 are exact in fp32).
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v[8];
        unpack8(a[mt][h], v);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[mt][h] += double(fmul(v[e], v[e]));
      }
      // Projection: 3 BF16 parts of fn x 2 k16 steps per n-tile and m-tile.
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      const float f[8] = {fb[nt][0].x, fb[nt][0].y, fb[nt][0].z, fb[nt][0].w,
                          fb[nt][1].x, fb[nt][1].y, fb[nt][1].z, fb[nt][1].w};
      uint32_t b[3][4];
      split3_fragments(f, b);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int sp = 0; sp < 3; ++sp) {
          sm90::mma_bf16_16816(acc[mt][nt], a[mt][0].x, a[mt][1].x, a[mt][0].y, a[mt][1].y,
                               b[sp][0], b[sp][1]);
          sm90::mma_bf16_16816(acc[mt][nt], a[mt][0].z, a[mt][1].z, a[mt][0].w, a[mt][1].w,
                               b[sp][2], b[sp][3]);
        }
    }
    if (more) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) fb[nt][0] = fnext[nt][0], fb[nt][1] = fnext[nt][1];
    }
  }

  // The 4 warps' partials (streams 0..3) added in that order; one partial per CTA and token.
  if constexpr (kStages > 0) {
    sm90::cp_async_wait<0>();  // (only empty groups are left) ...
    __syncthreads();           // ... and every warp is done with the ring that red overlays
  }
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = mt * 16 + g + 8 * (i >> 1), col = nt * 8 + 2 * tq + (i & 1);
        if (col < kMix) red[j][r][col] = acc[mt][nt][i];
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      double v = ss[mt][h];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (tq == 0) red_ss[j][mt * 16 + g + 8 * h] = v;
    }
  }
  __syncthreads();
  for (int o = threadIdx.x; o < rows * kMix; o += kSplitProjThreads) {
    const int r = o / kMix, v = o % kMix;
    float sum = red[0][r][v];
#pragma unroll
    for (int w = 1; w < kHc; ++w) sum = fadd(sum, red[w][r][v]);
    p.part_mix[(int64_t(t0 + r) * p.splits + s) * kMix + v] = sum;
  }
  for (int r = threadIdx.x; r < rows; r += kSplitProjThreads) {
    double sum = red_ss[0][r];
#pragma unroll
    for (int w = 1; w < kHc; ++w) sum += red_ss[w][r];
    p.part_ss[int64_t(t0 + r) * p.splits + s] = sum;
  }
}

// ---- 2. finish: one CTA per token ------------------------------------------------------------
// The FP8 quantisation of this token's y (values already BF16-rounded) by the collapse threads
// (whole warps: kCollapse is a multiple of 32). Thread ct holds chunks ct + i kCollapse of 8
// elements; kCollapse is a multiple of 16, so each half-warp holds the 16 chunks of one
// 128-element block, or (past the row's end: chunks % 16 == 0) none. Every lane runs every
// quantize_block8 (full-warp shuffles); lanes past the end quantise zeros and store nothing.
template <int kMaxC>
__device__ __forceinline__ void quantize_y(const FinishArgs& p, const float (&yv)[kMaxC][8], int ct,
                                           int chunks) {
  static_assert((kSplitFinishThreads - 32) % 32 == 0, "collapse threads: whole warps");
  if (p.q_codes == nullptr) return;  // uniform over the grid
  constexpr int kCollapse = kSplitFinishThreads - 32;
  const int64_t t = blockIdx.x;
#pragma unroll
  for (int i = 0; i < kMaxC; ++i) {
    const int c = ct + i * kCollapse;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = c < chunks ? yv[i][e] : 0.0f;
    uint32_t ex = 0;
    const uint2 codes = act_quant::quantize_block8(v, ex);
    if (c >= chunks) continue;
    *reinterpret_cast<uint2*>(p.q_codes + t * p.dim + int64_t(c) * 8) = codes;
    if (c % 16 == 0)
      act_quant::store_block_scale(p.q_scales_t, p.q_ld_scales, c / 16, t, int(gridDim.x), ex);
  }
}

// How the finishing kernel fetches the token's streams. kEarly (decode-sized steps): the norm
// weight before the wait and the streams right after it, so their round trips overlap the
// partials' reduction instead of following it, held in registers throughout (~2x the registers:
// one CTA per SM). kStaged (prefill-sized steps, many CTAs an SM): the streams copied by cp.async
// into shared memory right after the wait (each collapse thread the pieces it later reads, so its
// wait_group is the only synchronisation), overlapping the reduction with no registers held (the
// register-loaded kernel fetched them after the gates: ~1.5 TB/s at 8192 tokens). Same arithmetic.
enum class FinishLoad { kEarly, kStaged };
template <Kind kKind>
constexpr int finish_collapse_threads() {
  return kSplitFinishThreads - (kKind == Kind::kHead ? 0 : 32);
}
// kStaged's dynamic shared memory at a width: [i][stream][collapse thread] 16-byte pieces.
template <Kind kKind>
constexpr size_t finish_staged_smem(int dim) {
  const int c = finish_collapse_threads<kKind>();
  return size_t((dim / 8 + c - 1) / c) * kHc * c * 16;
}

template <Kind kKind, FinishLoad kLoad>
__global__ void __launch_bounds__(kSplitFinishThreads, kLoad == FinishLoad::kStaged ? 3 : 1)
    hc_split_finish_kernel(const FinishArgs p) {
  constexpr bool kEarly = kLoad == FinishLoad::kEarly;
  constexpr bool kStaged = kLoad == FinishLoad::kStaged;
  constexpr bool kHead = kKind == Kind::kHead;
  constexpr int kMix = mix_of<kKind>(), kV = kMix + 1;
  constexpr int kFirst = kHead ? 0 : 32;  // warp 0 runs Sinkhorn unless this is the head
  constexpr int kCollapse = finish_collapse_threads<kKind>();
  static_assert(kCollapse == kSplitFinishThreads - kFirst);
  constexpr int kMaxC = (kSplitMaxDim / 8 + kCollapse - 1) / kCollapse;
  extern __shared__ __align__(16) uint4 finish_dyn[];  // kStaged: [i][stream][ct]
  __shared__ double red[kSplitReduceParts][kV];
  __shared__ float pre_s[kHc], comb_s[16];
  __shared__ double red_y[kSplitFinishThreads / 32];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t = blockIdx.x;
  // Collapse threads: chunk c (8 dims) of y by thread ct, c = ct, ct + kCollapse, ...
  const int ct = tid - kFirst, chunks = p.dim / 8;
  const __nv_bfloat16* X = p.streams + t * kHc * p.dim;
  uint4 nw[kMaxC], raw[kMaxC][kHc];
  // Every chunk's loads at once (one L2/HBM round trip), then the arithmetic.
  const auto load_streams = [&] {
#pragma unroll
    for (int i = 0; i < kMaxC; ++i) {
      const int c = ct + i * kCollapse;
#pragma unroll
      for (int jj = 0; jj < kHc; ++jj)
        raw[i][jj] =
            ct >= 0 && c < chunks ? ld16(X + int64_t(jj) * p.dim + c * 8) : make_uint4(0, 0, 0, 0);
    }
  };
  const auto load_norm = [&] {
#pragma unroll
    for (int i = 0; i < kMaxC; ++i) {
      const int c = ct + i * kCollapse;
      nw[i] = ct >= 0 && c < chunks && p.norm_w != nullptr
                  ? __ldg(reinterpret_cast<const uint4*>(p.norm_w) + c)
                  : make_uint4(0, 0, 0, 0);
    }
  };
  if constexpr (kEarly) load_norm();  // a constant: under the projection's tail
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  if constexpr (kEarly) load_streams();  // written by the projection: after the wait
  if constexpr (kStaged) {
    if (ct >= 0) {
#pragma unroll
      for (int i = 0; i < kMaxC; ++i) {
        const int c = ct + i * kCollapse;
        if (c >= chunks) break;
#pragma unroll
        for (int jj = 0; jj < kHc; ++jj)
          sm90::cp_async_16(finish_dyn + (i * kHc + jj) * kCollapse + ct,
                            X + int64_t(jj) * p.dim + c * 8);
      }
      sm90::cp_async_commit();
    }
  }

  // Partials: value v (a mix, or the sum of squares at v == kMix) over kSplitReduceParts fixed
  // ranges of splits, each summed in split order in fp64, then the ranges in order. Every load of
  // a range is issued before the first addition (one L2 round trip, not one per few splits).
  if (tid < kSplitReduceParts * kV) {
    constexpr int kMaxPer = kSplitMaxSplitsPerPart;
    const int v = tid % kV, part = tid / kV;
    const int s0 = part * p.splits / kSplitReduceParts;
    const int s1 = (part + 1) * p.splits / kSplitReduceParts;
    double acc = 0.0;
    if (v < kMix) {
      const float* src = p.part_mix + (t * p.splits + s0) * kMix + v;
      float vals[kMaxPer];
#pragma unroll
      for (int i = 0; i < kMaxPer; ++i) vals[i] = s0 + i < s1 ? src[i * kMix] : 0.0f;
#pragma unroll
      for (int i = 0; i < kMaxPer; ++i)
        if (s0 + i < s1) acc += double(vals[i]);
    } else {
      const double* src = p.part_ss + t * p.splits + s0;
      double vals[kMaxPer];
#pragma unroll
      for (int i = 0; i < kMaxPer; ++i) vals[i] = s0 + i < s1 ? src[i] : 0.0;
#pragma unroll
      for (int i = 0; i < kMaxPer; ++i)
        if (s0 + i < s1) acc += vals[i];
    }
    red[part][v] = acc;
  }
  __syncthreads();
  if (warp == 0) {
    double sum = 0.0;
    if (lane < kV)
#pragma unroll
      for (int part = 0; part < kSplitReduceParts; ++part) sum += red[part][lane];
    const double ss = __shfl_sync(0xffffffffu, sum, kMix);
    const float ms = float(ss / double(kHc * p.dim));
    const float rs = __fdiv_rn(1.0f, __fsqrt_rn(fadd(ms, p.norm_eps)));
    const float m = fmul(float(sum), rs);
    if (lane < kHc)
      pre_s[lane] =
          fadd(sigmoidf_ref(fadd(fmul(m, __ldg(p.scale)), __ldg(p.base + lane))), p.hc_eps);
    if constexpr (!kHead) {
      if (lane >= kHc && lane < 2 * kHc)
        p.post[t * kHc + (lane - kHc)] =
            fmul(2.0f, sigmoidf_ref(fadd(fmul(m, __ldg(p.scale + 1)), __ldg(p.base + lane))));
      else if (lane >= 2 * kHc && lane < kMix) {
        const float logit = fadd(fmul(m, __ldg(p.scale + 2)), __ldg(p.base + lane));
        if constexpr (kStaged)
          p.comb[t * 16 + (lane - 2 * kHc)] = logit;  // hc_split_sinkhorn_kernel's input
        else
          comb_s[lane - 2 * kHc] = logit;
      }
    }
  }
  __syncthreads();
  if constexpr (!kHead) {
    if (warp == 0) {  // both half-warps normalise the same matrix (the shuffles need all lanes)
      if constexpr (!kStaged) {
        const float c = sinkhorn4_lanes(comb_s[lane & 15], p.iters, p.hc_eps);
        if (lane < 16) p.comb[t * 16 + lane] = c;
      }
      return;
    }
  }

  // Collapse.
  const float w0 = pre_s[0], w1 = pre_s[1], w2 = pre_s[2], w3 = pre_s[3];
  if constexpr (kStaged) {
    sm90::cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < kMaxC; ++i) {
      const int c = ct + i * kCollapse;
#pragma unroll
      for (int jj = 0; jj < kHc; ++jj)
        raw[i][jj] =
            c < chunks ? finish_dyn[(i * kHc + jj) * kCollapse + ct] : make_uint4(0, 0, 0, 0);
    }
  }
  float yv[kMaxC][8];
#pragma unroll
  for (int i = 0; i < kMaxC; ++i) {
    float xv[kHc][8];
#pragma unroll
    for (int jj = 0; jj < kHc; ++jj) unpack8(raw[i][jj], xv[jj]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float s = fmul(w0, xv[0][e]);
      s = fadd(s, fmul(w1, xv[1][e]));
      s = fadd(s, fmul(w2, xv[2][e]));
      s = fadd(s, fmul(w3, xv[3][e]));
      yv[i][e] = __bfloat162float(__float2bfloat16_rn(s));
    }
  }
  if (p.norm_w != nullptr) {  // uniform over the grid
    if constexpr (!kEarly) load_norm();
    // Fused RMSNorm: sum of squares of y (fp64, fixed order: lanes by butterfly, then warps).
    double ssy = 0.0;
#pragma unroll
    for (int i = 0; i < kMaxC; ++i) {
      const int c = ct + i * kCollapse;
      if (c >= chunks) continue;
#pragma unroll
      for (int e = 0; e < 8; ++e) ssy += double(fmul(yv[i][e], yv[i][e]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ssy += __shfl_xor_sync(0xffffffffu, ssy, o);
    if (lane == 0) red_y[warp] = ssy;
    sm90::named_barrier_sync(1, kCollapse);
    double sy = 0.0;
#pragma unroll
    for (int w = kFirst / 32; w < kSplitFinishThreads / 32; ++w) sy += red_y[w];
    const float ms = float(sy / double(p.dim));
    const float rs = __fdiv_rn(1.0f, __fsqrt_rn(fadd(ms, p.nrm_eps)));
#pragma unroll
    for (int i = 0; i < kMaxC; ++i) {
      const int c = ct + i * kCollapse;
      if (c >= chunks) continue;
      float wv[8];
      unpack8(nw[i], wv);
      // Rounded to BF16 here: the stored y, and what its FP8 codes are of.
#pragma unroll
      for (int e = 0; e < 8; ++e)
        yv[i][e] = __bfloat162float(__float2bfloat16_rn(fmul(wv[e], fmul(yv[i][e], rs))));
    }
  }
  uint4* Y = reinterpret_cast<uint4*>(p.y + t * p.dim);
#pragma unroll
  for (int i = 0; i < kMaxC; ++i) {
    const int c = ct + i * kCollapse;
    if (c < chunks) Y[c] = pack8(yv[i]);
  }
  if constexpr (!kHead) quantize_y(p, yv, ct, chunks);
}

// ---- 3. Sinkhorn apart (prefill-sized steps, after the staged finish) --------------------------
// The staged finishing kernel leaves the comb logits in `comb`; this normalises them in place,
// two tokens a warp (one a half-warp: sinkhorn4_lanes works on each half's own lanes), so the 20
// dependent iterations (~3 us a token) no longer hold a finishing CTA, and its SM slot, after its
// collapse is done. The same function on the same logits: the same bits as in the finish.
struct SinkhornArgs {
  float* comb = nullptr;  // [tokens, 16]: logits in, the doubly stochastic matrices out
  int tokens = 0, iters = 20;
  float eps = 1e-6f;
};
constexpr int kSinkhornThreads = 256;
constexpr int kSinkhornTokensPerCta = kSinkhornThreads / 16;

__global__ void __launch_bounds__(kSinkhornThreads) hc_split_sinkhorn_kernel(const SinkhornArgs p) {
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kSinkhornTokensPerCta + threadIdx.x / 16;
  const bool live = t < p.tokens;  // a dead half-warp normalises zeros: every lane must shuffle
  const float c = live ? p.comb[t * 16 + (lane & 15)] : 0.0f;
  const float r = sinkhorn4_lanes(c, p.iters, p.eps);
  if (live) p.comb[t * 16 + (lane & 15)] = r;
}

// ---- host side -------------------------------------------------------------------------------

// Partials workspace, one per (device, stream): ranks may run as threads on one GPU, each on its
// own stream. Grown under a lock and never freed while the process runs (a CUDA graph captured
// with a smaller buffer keeps pointing at it, so a grown buffer is retired, not freed). Growing
// inside a capture is refused (cudaMalloc there would break it); the first allocation covers
// every shape kAuto sends here (reserved_partials), and every eager mHC call at a
// width the split path takes reserves it (reserve_workspace), so a decode graph captured after
// any eager step (a prefill, the runner's warm-up) finds it in place. `bytes` == 0: reserve only,
// and only outside a capture.
void* workspace(size_t bytes, cudaStream_t stream) {
  struct Buffer {
    void* ptr = nullptr;
    size_t size = 0;
  };
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Buffer> buffers;
  static std::vector<void*> retired;
  const int dev = current_device();
  std::lock_guard<std::mutex> lock(mu);
  Buffer& b = buffers[{dev, stream}];
  if (b.ptr != nullptr && bytes <= b.size) return b.ptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DSV4_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (bytes == 0 && capture != cudaStreamCaptureStatusNone) return b.ptr;
  DSV4_CHECK(capture == cudaStreamCaptureStatusNone, "mHC: the split-K workspace must grow to ",
             bytes, " bytes (from ", b.size,
             ") inside a CUDA graph capture; run an mHC op on this stream eagerly first");
  if (b.ptr) retired.push_back(b.ptr);
  const size_t want =
      std::max(bytes, reserved_partials(sm_count()) * (kMixPre * sizeof(float) + sizeof(double)));
  DSV4_CUDA_CHECK(cudaMalloc(&b.ptr, want));
  b.size = want;
  return b.ptr;
}

template <typename Args>
void launch_pdl(void (*kernel)(Args), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                const Args& args) {
  launch_kernel(LaunchConfig{grid, dim3(threads, 1, 1), smem, stream, /*pdl=*/true}, kernel, args);
}

template <Kind kKind, int kMt, int kStages>
void launch_proj(dim3 grid, cudaStream_t stream, const ProjArgs& a) {
  constexpr auto kernel = hc_split_proj_kernel<kKind, kMt, kStages>;
  constexpr size_t smem = proj_smem_bytes<kKind, kMt, kStages>();
  if constexpr (smem > 48 * 1024) opt_in_dynamic_smem<kernel>(int(smem));
  launch_pdl(kernel, grid, kSplitProjThreads, smem, stream, a);
}

template <Kind kKind>
void launch_finish(const Params& p, const Geometry& geo, float* part_mix, double* part_ss,
                   cudaStream_t stream) {
  FinishArgs f;
  f.dim = p.dim;
  f.splits = geo.splits;
  f.iters = p.iters;
  f.norm_eps = p.norm_eps;
  f.hc_eps = p.hc_eps;
  f.streams = kKind == Kind::kPostPre ? p.streams_out : p.streams;
  f.base = p.base;
  f.scale = p.scale;
  f.norm_w = p.norm_w;
  f.nrm_eps = p.nrm_eps;
  f.part_mix = part_mix;
  f.part_ss = part_ss;
  f.y = p.y;
  f.post = p.post;
  f.comb = p.comb;
  f.q_codes = p.q_codes;
  f.q_scales_t = p.q_scales_t;
  f.q_ld_scales = p.q_ld_scales;
  if (p.tokens <= kSplitEarlyLoadMaxTokens) {
    launch_pdl(hc_split_finish_kernel<kKind, FinishLoad::kEarly>, dim3(p.tokens, 1, 1),
               kSplitFinishThreads, 0, stream, f);
  } else {
    constexpr auto kernel = hc_split_finish_kernel<kKind, FinishLoad::kStaged>;
    opt_in_dynamic_smem<kernel>(int(finish_staged_smem<kKind>(kSplitMaxDim)));
    launch_pdl(kernel, dim3(p.tokens, 1, 1), kSplitFinishThreads, finish_staged_smem<kKind>(p.dim),
               stream, f);
    if constexpr (kKind != Kind::kHead) {
      SinkhornArgs sa;
      sa.comb = p.comb;
      sa.tokens = p.tokens;
      sa.iters = p.iters;
      sa.eps = p.hc_eps;
      launch_pdl(hc_split_sinkhorn_kernel,
                 dim3((p.tokens + kSinkhornTokensPerCta - 1) / kSinkhornTokensPerCta, 1, 1),
                 kSinkhornThreads, 0, stream, sa);
    }
  }
}

template <Kind kKind>
void launch_kind(const Params& p, const Geometry& geo, float* part_mix, double* part_ss,
                 cudaStream_t stream) {
  ProjArgs a;
  a.tokens = p.tokens;
  a.dim = p.dim;
  a.splits = geo.splits;
  a.chunks_per_split = geo.chunks_per_split;
  a.streams = p.streams;
  a.x_prev = p.x_prev;
  a.res = p.res;
  a.post_prev = p.post_prev;
  a.comb_prev = p.comb_prev;
  a.streams_out = p.streams_out;
  a.fn = p.fn;
  a.part_mix = part_mix;
  a.part_ss = part_ss;
  const dim3 grid(geo.splits, geo.tiles, 1);
  if (geo.staged) {  // never for kPostPre (launch passes can_stage = false); tiles of 64 rows
    DSV4_CHECK(kKind != Kind::kPostPre, "mHC split path: no staged hc_post_pre projection");
    if constexpr (kKind != Kind::kPostPre)
      launch_proj<kKind, kSplitMaxMt, kSplitProjStages>(grid, stream, a);
  } else {
    switch (geo.rows / 16) {
      case 1:
        launch_proj<kKind, 1, 0>(grid, stream, a);
        break;
      case 2:
        launch_proj<kKind, 2, 0>(grid, stream, a);
        break;
      default:
        launch_proj<kKind, kSplitMaxMt, 0>(grid, stream, a);
        break;
    }
  }
  launch_finish<kKind>(p, geo, part_mix, part_ss, stream);
}

}  // namespace

size_t reserved_partials(int sm_count) {
  return size_t(64) * (2 * size_t(sm_count) + 8);
}

void reserve_workspace(cudaStream_t stream) {
  workspace(0, stream);
}

Geometry geometry(int dim, int tokens, int sm_count, bool can_stage) {
  Geometry g;
  g.rows = 16 * split_mtiles(tokens);
  g.tiles = (tokens + g.rows - 1) / g.rows;
  g.staged = can_stage && tokens >= kSplitStagedMinTokens;
  // At most two CTAs of 4 warps per SM over all tiles (one wave: the projection CTAs of the
  // largest tiles fit two per SM, by registers), every CTA at least one d-chunk.
  const int chunks = dim / kSplitDimUnit;
  const int per_tile = std::max(1, 2 * sm_count / g.tiles);
  g.chunks_per_split = (chunks + std::min(chunks, per_tile) - 1) / std::min(chunks, per_tile);
  g.splits = (chunks + g.chunks_per_split - 1) / g.chunks_per_split;
  return g;
}

void launch(const Params& p, cudaStream_t stream) {
  if (p.tokens == 0) return;
  DSV4_CHECK(split_supports_dim(p.dim), "mHC split path: dim ", p.dim, " is not a width it takes");
  const Geometry geo = geometry(p.dim, p.tokens, sm_count(), p.kind != Kind::kPostPre);
  DSV4_CHECK(geo.tiles <= 65535, "mHC split path: ", p.tokens,
             " tokens need more than 65535 tiles");
  const int mix = p.kind == Kind::kHead ? kMixHead : kMixPre;
  const size_t n_part = size_t(p.tokens) * geo.splits;
  const size_t mix_bytes = (n_part * mix * sizeof(float) + 15) / 16 * 16;
  uint8_t* ws = static_cast<uint8_t*>(workspace(mix_bytes + n_part * sizeof(double), stream));
  float* part_mix = reinterpret_cast<float*>(ws);
  double* part_ss = reinterpret_cast<double*>(ws + mix_bytes);
  switch (p.kind) {
    case Kind::kPre:
      launch_kind<Kind::kPre>(p, geo, part_mix, part_ss, stream);
      break;
    case Kind::kPostPre:
      launch_kind<Kind::kPostPre>(p, geo, part_mix, part_ss, stream);
      break;
    case Kind::kHead:
      launch_kind<Kind::kHead>(p, geo, part_mix, part_ss, stream);
      break;
  }
}

}  // namespace dsv4::cuda::mhc_split
