// mHC kernels (mhc.h). One cluster kernel serves hc_pre, hc_post_pre and hc_head:
//
//   grid (CS, token tiles), cluster (CS, 1, 1); CTA `rank` owns dims [rank*ds, (rank+1)*ds) of
//   all 4 streams of a tile of tc tokens. Warps 0-7 ("compute") own dw = ds/8 dims each.
//   A. compute warps bring their slice of the streams into shared memory (cp.async; for
//      hc_post_pre: the previous streams, then the new streams computed in place and written out)
//      and sum squares per token (fp64);
//   B. the projection m = X fn^T over the CTA's slice on tensor cores: mma.m16n8k16 BF16 with
//      each fp32 fn value split exactly into hi + mid + lo BF16 parts (X is BF16, so every product
//      is exact and accumulates in fp32); K is permuted identically on both operands so each
//      thread loads 16 contiguous bytes; warps' partials reduced in a fixed order;
//   C. cluster barrier; token t is owned by CTA t % CS, which sums the CS partials (rank order)
//      from distributed shared memory and computes pre (and post, comb) on warp 8;
//   D. cluster barrier; every CTA fetches pre for the tile, the compute warps collapse their
//      slice (and apply the fused RMSNorm after one more cluster reduction) while warp 8 runs
//      Sinkhorn for its tokens and writes post/comb.
// Arithmetic that the CPU does in fp32 uses explicitly rounded operations (no FMA contraction),
// so hc_post's outputs and the collapse are bit-identical to the CPU for identical inputs.
// Widths the cluster kernel does not take (mhc_cfg::slice_dims(dim) == 0) run mhc_token.cu's
// per-token kernel instead (dispatch_token); the cluster path's code is the same either way.
// Widths the split-K path takes (mhc_cfg::uses_split_kernel) run it (mhc_split.cu,
// dispatch_split) unless HcPath::kCluster forces the kernels here.
#include "ops/cuda/mhc/mhc.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/common/sm90/cp_async.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/common/sm90/warp_mma.cuh"
#include "ops/cuda/gemm/fp8_gemm.h"
#include "ops/cuda/mhc/mhc_config.h"
#include "ops/cuda/mhc/mhc_math.cuh"
#include "ops/cuda/mhc/mhc_split.h"
#include "ops/cuda/mhc/mhc_token.h"

namespace dsv4::cuda {
namespace {

namespace cg = cooperative_groups;
using namespace mhc_cfg;
using namespace mhc_math;

enum class Mode { kPre, kPostPre, kHead };

struct KParams {
  int tokens = 0, dim = 0, ds = 0, cs = 0, tc = 0, m_tiles = 0;
  int iters = 20;
  float norm_eps = 1e-6f, hc_eps = 1e-6f;
  const __nv_bfloat16* streams = nullptr;  // kPre / kHead input
  const __nv_bfloat16* x_prev = nullptr;   // kPostPre: sub-layer output [T, dim]
  const __nv_bfloat16* res = nullptr;      // kPostPre: previous streams
  const float* post_prev = nullptr;        // kPostPre
  const float* comb_prev = nullptr;        // kPostPre
  __nv_bfloat16* streams_out = nullptr;    // kPostPre: new streams
  const float* fn = nullptr;
  const float* base = nullptr;
  const float* scale = nullptr;
  const __nv_bfloat16* norm_w = nullptr;  // optional fused RMSNorm
  float nrm_eps = 1e-6f;
  __nv_bfloat16* y = nullptr;
  float* post_out = nullptr;
  float* comb_out = nullptr;
  FusedQuant quant;  // of y: in the split path's finishing kernel, else a launch after the op
  HcPath path = HcPath::kAuto;
};

// ---- small device helpers --------------------------------------------------------------------
// cp.async.wait_group with a count known only after unrolling (the instruction takes an
// immediate); counts past 5 wait for everything, which is merely conservative.
__device__ __forceinline__ void cp_async_wait_at_most(int n) {
  switch (n) {
    case 1:
      sm90::cp_async_wait<1>();
      break;
    case 2:
      sm90::cp_async_wait<2>();
      break;
    case 3:
      sm90::cp_async_wait<3>();
      break;
    case 4:
      sm90::cp_async_wait<4>();
      break;
    case 5:
      sm90::cp_async_wait<5>();
      break;
    default:
      sm90::cp_async_wait<0>();
      break;
  }
}

// Offset of a thread's 16 bytes of (m-tile mt, sub-chunk sc, stream j, row half h) in its warp's
// region: every access of a warp touches 512 contiguous bytes.
template <int kNsc>
__device__ __forceinline__ int xoff(int mt, int sc, int j, int h, int lane) {
  return ((((mt * kNsc + sc) * kHc + j) * 2 + h) * 32 + lane) * 16;
}

// ---- the cluster kernel --------------------------------------------------------------------
// kMaxMt: token tiles of 16 held per CTA (register arrays are sized for it): max_mtiles(kDw)
// for prefill, 1 for decode batches, where the registers saved let every fn chunk be in
// flight at once.
template <Mode kMode, int kDw, int kMaxMt>
__global__ void __launch_bounds__(kThreads, 1) hc_cluster_kernel(const KParams p) {
  constexpr int kMix = kMode == Mode::kHead ? kMixHead : kMixPre;
  constexpr int kNt = (kMix + 7) / 8;  // n8 tiles of the projection
  constexpr int kNsc = kDw / 32;

  extern __shared__ __align__(16) uint8_t smem[];
  const SmemLayout L = smem_layout(p.m_tiles, kDw);
  uint8_t* sx = smem + L.x;
  float* red = reinterpret_cast<float*>(smem + L.red);
  float* own_mix = red;
  double* own_ss = reinterpret_cast<double*>(smem + L.red + kOwnSsOffset);
  double* red_ss = reinterpret_cast<double*>(smem + L.red_ss);
  float* part_mix = reinterpret_cast<float*>(smem + L.part_mix);
  double* part_ss = reinterpret_cast<double*>(smem + L.part_ss);
  float* own_pre = reinterpret_cast<float*>(smem + L.own_pre);
  float* pre_all = reinterpret_cast<float*>(smem + L.pre_all);

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = blockIdx.x, cs = p.cs;
  const int t0 = blockIdx.y * p.tc;
  const int tc = min(p.tc, p.tokens - t0);  // tokens of this tile
  const int tcp = p.m_tiles * 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;
  const int64_t hd = int64_t(kHc) * p.dim;  // stream stride per token
  const int n_own = rank < tc ? (tc - rank + cs - 1) / cs : 0;

  // ================= A + B: compute warps =================
  if (warp < kComputeWarps) {
    uint8_t* xw = sx + warp * (p.m_tiles * 16 * kHc * kDw * 2);
    const int dbase = rank * p.ds + warp * kDw;  // first dim of this warp

    // Projection weights of chunk (sc, j): rows nt*8+g, 8 fp32 at k = j*dim + dbase + sc*32 + 8tq.
    // fn for the warp's chunks, prefetched kFnDepth - 1 chunks ahead (the chunk loop is fully
    // unrolled, so only the live window of fb occupies registers).
    constexpr int kChunks = kNsc * kHc;
    constexpr int kFnDepth = (kMode == Mode::kPostPre && kDw == 64) ? 2
                             : kMaxMt == 1                          ? (kChunks < 4 ? kChunks : 4)
                             : (kMaxMt <= 3 && kMode != Mode::kPostPre) ? 3
                                                                        : 2;
    float4 fb[kChunks][kNt][2];
    auto load_fn = [&](int c, float4(&f)[kNt][2]) {
      const int sc = c / kHc, j = c % kHc;
      const int64_t kf = int64_t(j) * p.dim + dbase + sc * 32 + 8 * tq;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const int r = nt * 8 + g;
        if (r < kMix) {
          const float4* src = reinterpret_cast<const float4*>(p.fn + int64_t(r) * hd + kf);
          f[nt][0] = __ldg(src);
          f[nt][1] = __ldg(src + 1);
        } else {
          f[nt][0] = f[nt][1] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
    };
#pragma unroll
    for (int c = 0; c < kFnDepth - 1 && c < kChunks; ++c) load_fn(c, fb[c]);

    // ---- A: the streams of the slice into shared memory ----
    // One cp.async group per m-tile (empty past p.m_tiles), so the sums of squares of an m-tile
    // start while the later ones are still in flight. Every 16-byte slot of the warp's region
    // is written and read by the same thread (xoff's lane term), so a per-thread wait suffices.
    const __nv_bfloat16* src_streams = kMode == Mode::kPostPre ? p.res : p.streams;
    auto copy_mtile = [&](int mt) {
#pragma unroll
      for (int sc = 0; sc < kNsc; ++sc)
#pragma unroll
        for (int j = 0; j < kHc; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = mt * 16 + g + 8 * h;
            const bool valid = row < tc;
            const __nv_bfloat16* src = valid ? src_streams + int64_t(t0 + row) * hd +
                                                   int64_t(j) * p.dim + dbase + sc * 32 + 8 * tq
                                             : src_streams;
            sm90::cp_async_16_zfill(xw + xoff<kNsc>(mt, sc, j, h, lane), src, valid ? 16 : 0);
          }
    };
    if constexpr (kMode == Mode::kPostPre) {
      for (int mt = 0; mt < p.m_tiles; ++mt) copy_mtile(mt);  // committed and waited below
    } else {
#pragma unroll
      for (int mt = 0; mt < kMaxMt; ++mt) {
        if (mt < p.m_tiles) copy_mtile(mt);
        sm90::cp_async_commit();
      }
    }

    if constexpr (kMode == Mode::kPostPre) {
      // post/comb of the tile's tokens -> part_mix (unused until B), 20 floats per token.
      float* pc = part_mix;
      for (int i = threadIdx.x; i < tcp * 20; i += kComputeThreads) {
        const int row = i / 20, v = i % 20;
        float val = 0.0f;
        // Plain (coherent) loads: next_post/next_comb may alias these and are written later
        // in this kernel, which rules out the read-only path.
        if (row < tc)
          val = v < 4 ? p.post_prev[int64_t(t0 + row) * 4 + v]
                      : p.comb_prev[int64_t(t0 + row) * 16 + (v - 4)];
        pc[i] = val;
      }
      // The sub-layer output x for this thread's rows, one m-tile ahead in registers.
      auto load_x = [&](int mt, uint4(&xr)[2][kNsc]) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int sc = 0; sc < kNsc; ++sc) {
            const int row = mt * 16 + g + 8 * h;
            xr[h][sc] = make_uint4(0, 0, 0, 0);
            if (mt < p.m_tiles && row < tc)
              xr[h][sc] = __ldg(reinterpret_cast<const uint4*>(
                  p.x_prev + int64_t(t0 + row) * p.dim + dbase + sc * 32 + 8 * tq));
          }
      };
      uint4 xcur[2][kNsc];
      load_x(0, xcur);
      sm90::cp_async_commit();
      sm90::cp_async_wait<0>();
      sm90::named_barrier_sync(1, kComputeThreads);  // post/comb staged
      // out_k = bf16(post_k x + sum_j comb[j][k] res_j), in place over res in shared memory.
      for (int mt = 0; mt < p.m_tiles; ++mt) {
        uint4 xnext[2][kNsc];
        load_x(mt + 1, xnext);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = mt * 16 + g + 8 * h;
          if (row >= tc) continue;
          const float* pcr = pc + row * 20;
          float post[4], comb[16];
#pragma unroll
          for (int i = 0; i < 4; ++i) post[i] = pcr[i];
#pragma unroll
          for (int i = 0; i < 16; ++i) comb[i] = pcr[4 + i];
#pragma unroll
          for (int sc = 0; sc < kNsc; ++sc) {
            float xv[8], rv[kHc][8];
            unpack8(xcur[h][sc], xv);
#pragma unroll
            for (int j = 0; j < kHc; ++j)
              unpack8(*reinterpret_cast<const uint4*>(xw + xoff<kNsc>(mt, sc, j, h, lane)), rv[j]);
#pragma unroll
            for (int k = 0; k < kHc; ++k) {
              float o[8];
#pragma unroll
              for (int e = 0; e < 8; ++e) {
                float s = fmul(comb[0 * 4 + k], rv[0][e]);
#pragma unroll
                for (int j = 1; j < kHc; ++j) s = fadd(s, fmul(comb[j * 4 + k], rv[j][e]));
                o[e] = fadd(fmul(post[k], xv[e]), s);
              }
              const uint4 ov = pack8(o);
              *reinterpret_cast<uint4*>(xw + xoff<kNsc>(mt, sc, k, h, lane)) = ov;
              *reinterpret_cast<uint4*>(p.streams_out + int64_t(t0 + row) * hd +
                                        int64_t(k) * p.dim + dbase + sc * 32 + 8 * tq) = ov;
            }
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int sc = 0; sc < kNsc; ++sc) xcur[h][sc] = xnext[h][sc];
      }
    }
    __syncwarp();

    // ---- sums of squares of the slice, per token (fp64; squares of BF16 are exact) ----
    auto sum_squares = [&](int mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        double ss = 0.0;
#pragma unroll
        for (int sc = 0; sc < kNsc; ++sc)
#pragma unroll
          for (int j = 0; j < kHc; ++j) {
            float v[8];
            unpack8(*reinterpret_cast<const uint4*>(xw + xoff<kNsc>(mt, sc, j, h, lane)), v);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += double(v[e] * v[e]);
          }
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        ss += __shfl_xor_sync(0xffffffffu, ss, 2);
        if (tq == 0) red_ss[warp * tcp + mt * 16 + g + 8 * h] = ss;
      }
    };
    if constexpr (kMode == Mode::kPostPre) {
      for (int mt = 0; mt < p.m_tiles; ++mt) sum_squares(mt);  // every group waited above
    } else {
#pragma unroll
      for (int mt = 0; mt < kMaxMt; ++mt) {
        if (mt >= p.m_tiles) break;
        // m-tile mt has landed once at most the kMaxMt - 1 - mt later groups are in flight.
        cp_async_wait_at_most(kMaxMt - 1 - mt);
        sum_squares(mt);
      }
    }

    // ---- B: projection on tensor cores ----
    float acc[kMaxMt][kNt][4];
#pragma unroll
    for (int mt = 0; mt < kMaxMt; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (c + kFnDepth - 1 < kChunks) load_fn(c + kFnDepth - 1, fb[c + kFnDepth - 1]);
      const int sc = c / kHc, j = c % kHc;
      // One n-tile at a time: B fragments (hi, mid, lo) x {step0 b0, b1, step1 b0, b1}.
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const float f[8] = {fb[c][nt][0].x, fb[c][nt][0].y, fb[c][nt][0].z, fb[c][nt][0].w,
                            fb[c][nt][1].x, fb[c][nt][1].y, fb[c][nt][1].z, fb[c][nt][1].w};
        uint32_t b[3][4];
        split3_fragments(f, b);
#pragma unroll
        for (int mt = 0; mt < kMaxMt; ++mt) {
          if (mt < p.m_tiles) {
            const uint4 va = *reinterpret_cast<const uint4*>(xw + xoff<kNsc>(mt, sc, j, 0, lane));
            const uint4 vb = *reinterpret_cast<const uint4*>(xw + xoff<kNsc>(mt, sc, j, 1, lane));
#pragma unroll
            for (int s = 0; s < 3; ++s) {
              sm90::mma_bf16_16816(acc[mt][nt], va.x, vb.x, va.y, vb.y, b[s][0], b[s][1]);
              sm90::mma_bf16_16816(acc[mt][nt], va.z, vb.z, va.w, vb.w, b[s][2], b[s][3]);
            }
          }
        }
      }
    }

    // ---- fixed-order reduction over the 8 warps, one m-tile at a time ----
#pragma unroll
    for (int mt = 0; mt < kMaxMt; ++mt) {
      if (mt >= p.m_tiles) break;
      float* rw = red + warp * (16 * kMix);
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = g + 8 * (i >> 1), col = nt * 8 + 2 * tq + (i & 1);
          if (col < kMix) rw[r * kMix + col] = acc[mt][nt][i];
        }
      sm90::named_barrier_sync(1, kComputeThreads);
      for (int o = threadIdx.x; o < 16 * kMix; o += kComputeThreads) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kComputeWarps; ++w) s += red[w * 16 * kMix + o];
        part_mix[(mt * 16 + o / kMix) * kMix + o % kMix] = s;
      }
      sm90::named_barrier_sync(1, kComputeThreads);
    }
    for (int row = threadIdx.x; row < tcp; row += kComputeThreads) {
      double s = 0.0;
#pragma unroll
      for (int w = 0; w < kComputeWarps; ++w) s += red_ss[w * tcp + row];
      part_ss[row] = s;
    }
  }

  // ================= C: owners reduce across the cluster =================
  sm90::cluster_arrive();
  sm90::cluster_wait();
  {
    const int items = n_own * (kMix + 1);
    for (int it = threadIdx.x; it < items; it += kThreads) {
      const int o = it / (kMix + 1), v = it % (kMix + 1);
      const int tl = rank + o * cs;
      if (v < kMix) {
        float vals[kMaxCluster];
#pragma unroll
        for (int r = 0; r < kMaxCluster; ++r)
          vals[r] = r < cs ? cluster.map_shared_rank(part_mix, r)[tl * kMix + v] : 0.0f;
        float s = 0.0f;
#pragma unroll
        for (int r = 0; r < kMaxCluster; ++r)
          if (r < cs) s += vals[r];
        own_mix[o * (kMix + 1) + v] = s;
      } else {
        double vals[kMaxCluster];
#pragma unroll
        for (int r = 0; r < kMaxCluster; ++r)
          vals[r] = r < cs ? cluster.map_shared_rank(part_ss, r)[tl] : 0.0;
        double s = 0.0;
#pragma unroll
        for (int r = 0; r < kMaxCluster; ++r)
          if (r < cs) s += vals[r];
        own_ss[o] = s;
      }
    }
  }
  __syncthreads();
  // Warp 8: the weights of the owned tokens; post and the raw comb replace the token's mixes
  // in own_mix (read back for Sinkhorn).
  if (warp == kComputeWarps) {
    for (int o = lane; o < n_own; o += 32) {
      float* om = own_mix + o * (kMix + 1);
      const float ms = float(own_ss[o] / double(hd));
      const float rs = __fdiv_rn(1.0f, __fsqrt_rn(fadd(ms, p.norm_eps)));
      float m[kMix];
#pragma unroll
      for (int v = 0; v < kMix; ++v) m[v] = fmul(om[v], rs);
      const float s0 = __ldg(p.scale);
#pragma unroll
      for (int j = 0; j < kHc; ++j)
        own_pre[o * kHc + j] =
            fadd(sigmoidf_ref(fadd(fmul(m[j], s0), __ldg(p.base + j))), p.hc_eps);
      if constexpr (kMode != Mode::kHead) {
        const float s1 = __ldg(p.scale + 1), s2 = __ldg(p.scale + 2);
#pragma unroll
        for (int j = 0; j < kHc; ++j)
          om[j] = fmul(2.0f, sigmoidf_ref(fadd(fmul(m[kHc + j], s1), __ldg(p.base + kHc + j))));
#pragma unroll
        for (int i = 0; i < 16; ++i)
          om[kHc + i] = fadd(fmul(m[2 * kHc + i], s2), __ldg(p.base + 2 * kHc + i));
      }
    }
  }

  // ================= D: pre weights to every CTA, collapse, Sinkhorn =================
  sm90::cluster_arrive();
  sm90::cluster_wait();
  for (int it = threadIdx.x; it < tc * kHc; it += kThreads) {
    const int tl = it / kHc, j = it % kHc;
    pre_all[it] = cluster.map_shared_rank(own_pre, tl % cs)[(tl / cs) * kHc + j];
  }
  __syncthreads();
  const bool has_norm = p.norm_w != nullptr;

  if (warp == kComputeWarps) {
    // No remote reads after this point: let the cluster proceed, then Sinkhorn.
    sm90::cluster_arrive();
    if constexpr (kMode != Mode::kHead) {
      // Few owned tokens (decode): 16 lanes per token, two tokens per pass, which shortens the
      // dependent chain of the 39 normalisations (one division per lane instead of 16 per
      // thread). Otherwise one lane per token. Both are the CPU's operations in its order.
      if (n_own <= kLaneSinkhornMaxOwned) {
        const int e = lane & 15;
        for (int o0 = 0; o0 < n_own; o0 += 2) {  // uniform over the warp (shuffles inside)
          const int o = o0 + (lane >> 4);
          const bool active = o < n_own;
          const float* om = own_mix + o * (kMix + 1);  // in bounds: o <= n_own < 96
          const float c = sinkhorn4_lanes(active ? om[kHc + e] : 0.0f, p.iters, p.hc_eps);
          if (active) {
            const int t = t0 + rank + o * cs;
            p.comb_out[int64_t(t) * 16 + e] = c;
            if (e < kHc) p.post_out[int64_t(t) * 4 + e] = om[e];
          }
        }
      } else {
        for (int o = lane; o < n_own; o += 32) {
          const float* om = own_mix + o * (kMix + 1);
          const int t = t0 + rank + o * cs;
          float comb_reg[16];
#pragma unroll
          for (int i = 0; i < 16; ++i) comb_reg[i] = om[kHc + i];
          sinkhorn4(comb_reg, p.iters, p.hc_eps);
          float4* po = reinterpret_cast<float4*>(p.post_out + int64_t(t) * 4);
          po[0] = make_float4(om[0], om[1], om[2], om[3]);
          float4* co = reinterpret_cast<float4*>(p.comb_out + int64_t(t) * 16);
#pragma unroll
          for (int q = 0; q < 4; ++q)
            co[q] = make_float4(comb_reg[4 * q], comb_reg[4 * q + 1], comb_reg[4 * q + 2],
                                comb_reg[4 * q + 3]);
        }
      }
    }
    sm90::cluster_wait();
    if (has_norm) {
      sm90::cluster_arrive();
      sm90::cluster_wait();
    }
    return;
  }

  // Compute warps: y = bf16(sum_j pre_j h_j) over the slice (then the fused RMSNorm).
  const uint8_t* xw = sx + warp * (p.m_tiles * 16 * kHc * kDw * 2);
  const int dbase = rank * p.ds + warp * kDw;
  auto collapse = [&](int mt, int sc, int h, float(&yv)[8]) {
    const int row = mt * 16 + g + 8 * h;
    const float* pr = pre_all + row * kHc;
    float xv[kHc][8];
#pragma unroll
    for (int j = 0; j < kHc; ++j)
      unpack8(*reinterpret_cast<const uint4*>(xw + xoff<kNsc>(mt, sc, j, h, lane)), xv[j]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float s = fmul(pr[0], xv[0][e]);
#pragma unroll
      for (int j = 1; j < kHc; ++j) s = fadd(s, fmul(pr[j], xv[j][e]));
      yv[e] = __bfloat162float(__float2bfloat16_rn(s));
    }
  };
  if (!has_norm) {
    sm90::cluster_arrive();  // the pre_all reads were the last remote accesses
    for (int mt = 0; mt < p.m_tiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mt * 16 + g + 8 * h;
        if (row >= tc) continue;
#pragma unroll
        for (int sc = 0; sc < kNsc; ++sc) {
          float yv[8];
          collapse(mt, sc, h, yv);
          *reinterpret_cast<uint4*>(p.y + int64_t(t0 + row) * p.dim + dbase + sc * 32 + 8 * tq) =
              pack8(yv);
        }
      }
    sm90::cluster_wait();
    return;
  }

  // Fused RMSNorm: per-token sum of squares of y over the cluster, then y * rs * w.
  for (int mt = 0; mt < p.m_tiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = mt * 16 + g + 8 * h;
      double ss = 0.0;
      if (row < tc) {
#pragma unroll
        for (int sc = 0; sc < kNsc; ++sc) {
          float yv[8];
          collapse(mt, sc, h, yv);
#pragma unroll
          for (int e = 0; e < 8; ++e) ss += double(yv[e] * yv[e]);
        }
      }
      ss += __shfl_xor_sync(0xffffffffu, ss, 1);
      ss += __shfl_xor_sync(0xffffffffu, ss, 2);
      if (tq == 0) red_ss[warp * tcp + row] = ss;
    }
  sm90::named_barrier_sync(1, kComputeThreads);
  for (int row = threadIdx.x; row < tcp; row += kComputeThreads) {
    double s = 0.0;
#pragma unroll
    for (int w = 0; w < kComputeWarps; ++w) s += red_ss[w * tcp + row];
    part_ss[row] = s;  // the streams' partials were consumed before the second barrier
  }
  sm90::cluster_arrive();
  sm90::cluster_wait();
  float* rs_row = reinterpret_cast<float*>(red_ss);  // fp32 norm factors, per token
  sm90::named_barrier_sync(1, kComputeThreads);      // everyone is done reading red_ss
  for (int row = threadIdx.x; row < tc; row += kComputeThreads) {
    double vals[kMaxCluster];
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r)
      vals[r] = r < cs ? cluster.map_shared_rank(part_ss, r)[row] : 0.0;
    double s = 0.0;
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r)
      if (r < cs) s += vals[r];
    const float ms = float(s / double(p.dim));
    rs_row[row] = __fdiv_rn(1.0f, __fsqrt_rn(fadd(ms, p.nrm_eps)));
  }
  sm90::named_barrier_sync(1, kComputeThreads);
  sm90::cluster_arrive();  // remote reads done
#pragma unroll
  for (int sc = 0; sc < kNsc; ++sc) {
    float wv[8];
    unpack8(__ldg(reinterpret_cast<const uint4*>(p.norm_w + dbase + sc * 32 + 8 * tq)), wv);
    for (int mt = 0; mt < p.m_tiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mt * 16 + g + 8 * h;
        if (row >= tc) continue;
        const float rs = rs_row[row];
        float yv[8];
        collapse(mt, sc, h, yv);
#pragma unroll
        for (int e = 0; e < 8; ++e) yv[e] = fmul(wv[e], fmul(yv[e], rs));
        *reinterpret_cast<uint4*>(p.y + int64_t(t0 + row) * p.dim + dbase + sc * 32 + 8 * tq) =
            pack8(yv);
      }
  }
  sm90::cluster_wait();
}

// ---- hc_post (unfused, elementwise) ------------------------------------------------------------
__global__ void hc_post_kernel(HcPostParams p) {
  const int per_token = p.shape.dim / 8;
  const int64_t n = int64_t(p.tokens) * per_token;
  const int64_t hd = int64_t(kHc) * p.shape.dim;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_token;
    const int d = int(i % per_token) * 8;
    float post[4], comb[16];
    const float4 pv = __ldg(reinterpret_cast<const float4*>(p.post + t * 4));
    post[0] = pv.x, post[1] = pv.y, post[2] = pv.z, post[3] = pv.w;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 cv = __ldg(reinterpret_cast<const float4*>(p.comb + t * 16) + q);
      comb[4 * q] = cv.x, comb[4 * q + 1] = cv.y, comb[4 * q + 2] = cv.z, comb[4 * q + 3] = cv.w;
    }
    float xv[8], rv[kHc][8];
    unpack8(__ldg(reinterpret_cast<const uint4*>(p.x + t * p.shape.dim + d)), xv);
#pragma unroll
    for (int j = 0; j < kHc; ++j)
      unpack8(*reinterpret_cast<const uint4*>(p.res + t * hd + int64_t(j) * p.shape.dim + d),
              rv[j]);
#pragma unroll
    for (int k = 0; k < kHc; ++k) {
      float o[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float s = fmul(comb[k], rv[0][e]);
#pragma unroll
        for (int j = 1; j < kHc; ++j) s = fadd(s, fmul(comb[j * 4 + k], rv[j][e]));
        o[e] = fadd(fmul(post[k], xv[e]), s);
      }
      *reinterpret_cast<uint4*>(p.out + t * hd + int64_t(k) * p.shape.dim + d) = pack8(o);
    }
  }
}

// ---- host side
// -----------------------------------------------------------------------------------
bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

bool finite_eps(float e) {
  return std::isfinite(e) && e >= 0.0f;
}

void check_shape(const HcShape& s, const char* what) {
  DSV4_CHECK(s.hc == kHc, what, ": hc = ", s.hc, " (the kernels are written for hc = 4)");
  DSV4_CHECK(supported_dim(s.dim), what, ": dim = ", s.dim,
             " must be a positive multiple of 8, at most ", kMaxDim);
  DSV4_CHECK(s.sinkhorn_iters >= 1, what, ": sinkhorn_iters = ", s.sinkhorn_iters);
  DSV4_CHECK(finite_eps(s.norm_eps) && finite_eps(s.hc_eps), what, ": norm_eps ", s.norm_eps,
             ", hc_eps ", s.hc_eps, " must be finite and >= 0");
}

// Largest number of co-resident clusters of `cs` CTAs for a kernel instantiation (cached).
template <Mode kMode, int kDw, int kMaxMt>
int max_clusters(int cs) {
  auto kernel = hc_cluster_kernel<kMode, kDw, kMaxMt>;
  const size_t max_smem = smem_layout(kMaxMt, kDw).total;
  static std::mutex mu;
  static int cached_per_device[kMaxDevices][kMaxCluster + 1] = {};  // attributes: per device
  int* cached = cached_per_device[current_device()];
  std::lock_guard<std::mutex> lock(mu);
  if (cached[cs] == 0) {
    DSV4_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(max_smem)));
    DSV4_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(cs, 1, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = max_smem;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cs;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int n = 0;
    DSV4_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
    DSV4_CHECK(n > 0, "mHC: the device cannot co-schedule a cluster of ", cs, " CTAs with ",
               max_smem, " bytes of shared memory each");
    cached[cs] = n;
  }
  return cached[cs];
}

template <Mode kMode, int kDw, int kMaxMt>
void launch_tiles(const KParams& kp, cudaStream_t stream) {
  max_clusters<kMode, kDw, kMaxMt>(kp.cs);  // sets the function attributes once
  const int tiles = (kp.tokens + kp.tc - 1) / kp.tc;
  DSV4_CHECK(tiles <= 65535, "mHC: ", kp.tokens, " tokens need more than 65535 tiles");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(kp.cs, tiles, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem_layout(kp.m_tiles, kDw).total;
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = kp.cs;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  DSV4_CUDA_CHECK(cudaLaunchKernelEx(&cfg, hc_cluster_kernel<kMode, kDw, kMaxMt>, kp));
}

void launch_post(const HcPostParams& p, cudaStream_t stream) {
  const int64_t n = int64_t(p.tokens) * (p.shape.dim / 8);
  const int threads = 256;
  const int blocks = int(std::min<int64_t>((n + threads - 1) / threads, 132 * 16));
  hc_post_kernel<<<blocks, threads, 0, stream>>>(p);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

// hc_post_pre's hc_post half as a stand-alone hc_post (the previous layer's output into the
// new streams).
HcPostParams post_part(const KParams& kp) {
  HcPostParams q;
  q.shape.dim = kp.dim;
  q.tokens = kp.tokens;
  q.x = kp.x_prev;
  q.res = kp.res;
  q.post = kp.post_prev;
  q.comb = kp.comb_prev;
  q.out = kp.streams_out;
  return q;
}
template <Mode kMode, int kDw>
void launch_cluster(KParams kp, cudaStream_t stream) {
  constexpr int kMaxMt = max_mtiles(kDw);
  // Tokens per cluster tile: as many as fit, but spread small batches over every cluster slot
  // (counted for the prefill instantiation, one CTA per SM; kPostPre has kPre's geometry and
  // never runs more than one m-tile, below).
  constexpr Mode kCountMode = kMode == Mode::kPostPre ? Mode::kPre : kMode;
  const int clusters = max_clusters<kCountMode, kDw, kMaxMt>(kp.cs);
  const int max_tc = kMaxMt * 16;
  const int spread = (kp.tokens + clusters - 1) / clusters;
  kp.tc = spread < max_tc ? spread : max_tc;
  kp.m_tiles = (kp.tc + 15) / 16;
  if constexpr (kMode == Mode::kPostPre) {
    // With more than one m-tile per cluster tile the fused kernel's hc_post part (8 warps on
    // one CTA per SM, serialised with the rest of the tile) costs more than the streaming
    // hc_post kernel plus hc_pre's second read of the streams (H200, 8K tokens: 1324 vs 877 us
    // for Flash). The same arithmetic in the same order, so the results are bit-identical.
    if (kp.m_tiles > 1) {
      launch_post(post_part(kp), stream);
      kp.streams = kp.streams_out;
      launch_cluster<Mode::kPre, kDw>(kp, stream);
      return;
    }
  }
  if constexpr (kMode == Mode::kPostPre)
    launch_tiles<kMode, kDw, 1>(kp, stream);  // m_tiles == 1 here
  else if (kp.m_tiles == 1)
    launch_tiles<kMode, kDw, 1>(kp, stream);
  else
    launch_tiles<kMode, kDw, kMaxMt>(kp, stream);
}

// Widths the cluster kernel does not take: the per-token kernel (mhc_token.h); hc_post_pre as
// the streaming hc_post, then hc_pre over the new streams (the CPU's two steps).
template <Mode kMode>
void dispatch_token(const KParams& kp, cudaStream_t stream) {
  if constexpr (kMode == Mode::kPostPre) {
    launch_post(post_part(kp), stream);
  }
  mhc_token::Params t;
  t.head = kMode == Mode::kHead;
  t.tokens = kp.tokens;
  t.dim = kp.dim;
  t.iters = kp.iters;
  t.norm_eps = kp.norm_eps;
  t.hc_eps = kp.hc_eps;
  t.streams = kMode == Mode::kPostPre ? kp.streams_out : kp.streams;
  t.fn = kp.fn;
  t.base = kp.base;
  t.scale = kp.scale;
  t.norm_w = kp.norm_w;
  t.nrm_eps = kp.nrm_eps;
  t.y = kp.y;
  t.post = kp.post_out;
  t.comb = kp.comb_out;
  mhc_token::launch(t, stream);
}

// The split-K path (mhc_split.h). hc_post_pre past kSplitFusedPostMaxTokens: the streaming
// hc_post, then the split hc_pre over the new streams (the same arithmetic, bit-identical).
template <Mode kMode>
void dispatch_split(KParams kp, cudaStream_t stream) {
  if constexpr (kMode == Mode::kPostPre) {
    if (kp.tokens > kSplitFusedPostMaxTokens) {
      launch_post(post_part(kp), stream);
      kp.streams = kp.streams_out;
      dispatch_split<Mode::kPre>(kp, stream);
      return;
    }
  }
  mhc_split::Params t;
  t.kind = kMode == Mode::kPre       ? mhc_split::Kind::kPre
           : kMode == Mode::kPostPre ? mhc_split::Kind::kPostPre
                                     : mhc_split::Kind::kHead;
  t.tokens = kp.tokens;
  t.dim = kp.dim;
  t.iters = kp.iters;
  t.norm_eps = kp.norm_eps;
  t.hc_eps = kp.hc_eps;
  t.streams = kp.streams;
  t.x_prev = kp.x_prev;
  t.res = kp.res;
  t.post_prev = kp.post_prev;
  t.comb_prev = kp.comb_prev;
  t.streams_out = kp.streams_out;
  t.fn = kp.fn;
  t.base = kp.base;
  t.scale = kp.scale;
  t.norm_w = kp.norm_w;
  t.nrm_eps = kp.nrm_eps;
  t.y = kp.y;
  t.post = kp.post_out;
  t.comb = kp.comb_out;
  t.q_codes = kp.quant.codes;
  t.q_scales_t = kp.quant.scales_t;
  t.q_ld_scales = kp.quant.ld_scales;
  mhc_split::launch(t, stream);
}

// The fused quantisation where the path's kernels do not quantise: quantize_act_fp8 of y right
// after them (chained programmatically), the same bytes.
void quantize_after(const KParams& kp, cudaStream_t stream) {
  if (kp.quant.codes == nullptr) return;
  ActQuantParams q;
  q.x = kp.y;
  q.m = kp.tokens;
  q.k = kp.dim;
  q.codes = kp.quant.codes;
  q.scales_t = kp.quant.scales_t;
  q.ld_scales = kp.quant.ld_scales;
  q.pdl = true;
  quantize_act_fp8(q, stream);
}

template <Mode kMode>
void dispatch(KParams kp, cudaStream_t stream) {
  DSV4_CHECK(kp.path != HcPath::kSplit || split_supports_dim(kp.dim),
             "mHC: the split-K path was asked for at dim ", kp.dim,
             "; it takes widths that are a multiple of ", kSplitDimUnit, " up to ", kSplitMaxDim);
  if (split_supports_dim(kp.dim)) mhc_split::reserve_workspace(stream);
  if (kp.path == HcPath::kSplit ||
      (kp.path == HcPath::kAuto && uses_split_kernel(kp.dim, kp.tokens))) {
    dispatch_split<kMode>(kp, stream);
    return;
  }
  const int ds = slice_dims(kp.dim);
  if (ds == 0) {
    dispatch_token<kMode>(kp, stream);
    quantize_after(kp, stream);
    return;
  }
  kp.ds = ds;
  kp.cs = kp.dim / ds;
  if (ds == 256)
    launch_cluster<kMode, 32>(kp, stream);
  else
    launch_cluster<kMode, 64>(kp, stream);
  quantize_after(kp, stream);
}

void fill_quant(KParams& kp, const FusedQuant& q, const char* what) {
  if (q.codes == nullptr) return;
  DSV4_CHECK(kp.dim % 128 == 0, what,
             ": the fused FP8 quantisation needs dim % 128 == 0, dim = ", kp.dim);
  DSV4_CHECK(q.scales_t != nullptr, what, ": fused FP8 quantisation without scales");
  DSV4_CHECK(aligned16(q.codes) && aligned16(q.scales_t), what,
             ": quantisation codes and scales must be 16-byte aligned");
  DSV4_CHECK(q.ld_scales >= kp.tokens && q.ld_scales % 4 == 0, what, ": scales ld ", q.ld_scales,
             " must be >= tokens (", kp.tokens, ") and a multiple of 4");
  kp.quant = q;
}

void fill_unit(KParams& kp, const HcUnitParams& u, const FusedNorm& n, const char* what) {
  DSV4_CHECK(u.fn && u.base && u.scale, what, ": null HC unit parameter");
  DSV4_CHECK(aligned16(u.fn), what, ": fn must be 16-byte aligned");
  kp.fn = u.fn;
  kp.base = u.base;
  kp.scale = u.scale;
  kp.norm_w = n.weight;
  kp.nrm_eps = n.eps;
  if (n.weight) {
    DSV4_CHECK(aligned16(n.weight), what, ": norm weight must be 16-byte aligned");
    DSV4_CHECK(finite_eps(n.eps), what, ": norm eps ", n.eps, " must be finite and >= 0");
  }
}

KParams base_params(const HcShape& s, int tokens) {
  KParams kp;
  kp.tokens = tokens;
  kp.dim = s.dim;
  kp.iters = s.sinkhorn_iters;
  kp.norm_eps = s.norm_eps;
  kp.hc_eps = s.hc_eps;
  return kp;
}

}  // namespace

void hc_pre(const HcPreParams& p, cudaStream_t stream) {
  check_shape(p.shape, "hc_pre");
  DSV4_CHECK(p.tokens >= 0, "hc_pre: tokens = ", p.tokens);
  if (p.tokens == 0) return;
  DSV4_CHECK(p.streams && p.y && p.post && p.comb, "hc_pre: null pointer");
  DSV4_CHECK(aligned16(p.streams) && aligned16(p.y) && aligned16(p.post) && aligned16(p.comb),
             "hc_pre: pointers must be 16-byte aligned");
  KParams kp = base_params(p.shape, p.tokens);
  fill_unit(kp, p.unit, p.norm, "hc_pre");
  kp.streams = p.streams;
  kp.y = p.y;
  kp.post_out = p.post;
  kp.comb_out = p.comb;
  kp.path = p.path;
  fill_quant(kp, p.quant, "hc_pre");
  dispatch<Mode::kPre>(kp, stream);
}

void hc_post(const HcPostParams& p, cudaStream_t stream) {
  check_shape(p.shape, "hc_post");
  DSV4_CHECK(p.tokens >= 0, "hc_post: tokens = ", p.tokens);
  if (p.tokens == 0) return;
  DSV4_CHECK(p.x && p.res && p.post && p.comb && p.out, "hc_post: null pointer");
  DSV4_CHECK(aligned16(p.x) && aligned16(p.res) && aligned16(p.post) && aligned16(p.comb) &&
                 aligned16(p.out),
             "hc_post: pointers must be 16-byte aligned");
  launch_post(p, stream);
}

void hc_post_pre(const HcPostPreParams& p, cudaStream_t stream) {
  const HcPostParams& q = p.post;
  check_shape(q.shape, "hc_post_pre");
  DSV4_CHECK(q.tokens >= 0, "hc_post_pre: tokens = ", q.tokens);
  if (q.tokens == 0) return;
  DSV4_CHECK(q.x && q.res && q.post && q.comb && q.out && p.y && p.next_post && p.next_comb,
             "hc_post_pre: null pointer");
  DSV4_CHECK(aligned16(q.x) && aligned16(q.res) && aligned16(q.post) && aligned16(q.comb) &&
                 aligned16(q.out) && aligned16(p.y) && aligned16(p.next_post) &&
                 aligned16(p.next_comb),
             "hc_post_pre: pointers must be 16-byte aligned");
  KParams kp = base_params(q.shape, q.tokens);
  fill_unit(kp, p.unit, p.norm, "hc_post_pre");
  kp.x_prev = q.x;
  kp.res = q.res;
  kp.post_prev = q.post;
  kp.comb_prev = q.comb;
  kp.streams_out = q.out;
  kp.y = p.y;
  kp.post_out = p.next_post;
  kp.comb_out = p.next_comb;
  kp.path = p.path;
  fill_quant(kp, p.quant, "hc_post_pre");
  dispatch<Mode::kPostPre>(kp, stream);
}

void hc_head(const HcHeadParams& p, cudaStream_t stream) {
  check_shape(p.shape, "hc_head");
  DSV4_CHECK(p.tokens >= 0, "hc_head: tokens = ", p.tokens);
  if (p.tokens == 0) return;
  DSV4_CHECK(p.streams && p.y, "hc_head: null pointer");
  DSV4_CHECK(aligned16(p.streams) && aligned16(p.y), "hc_head: pointers must be 16-byte aligned");
  KParams kp = base_params(p.shape, p.tokens);
  fill_unit(kp, p.unit, p.norm, "hc_head");
  kp.streams = p.streams;
  kp.y = p.y;
  kp.path = p.path;
  dispatch<Mode::kHead>(kp, stream);
}

}  // namespace dsv4::cuda
