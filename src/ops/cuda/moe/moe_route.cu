// MoE kernels around the expert GEMMs: router logits, top-k / hash selection with the x
// quantisation, grouping by expert, FP8 fake-quantisation of rows, combine.
#include <cuda_bf16.h>

#include <cmath>

#include "ops/cuda/common/numerics.cuh"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/moe/moe.h"
#include "ops/cuda/moe/moe_config.h"
#include "ops/cuda/moe/moe_kernels.h"

namespace dsv4::cuda::moe {
namespace {

// ---- router logits ---------------------------------------------------------------------
// out[z][m][e] = sum over k in split z of x[m][k] * gate[e][k]: products of BF16 values are
// exact in fp32; runs of kRouterRun are summed in fp32, the runs in double (the CPU sums the
// exact products in double and rounds once; route_finish rounds the total to fp32).
template <int TM, int TE, int RT, int RE>
__global__ void __launch_bounds__(256)
    router_logits_kernel(const __nv_bfloat16* __restrict__ x, const uint16_t* __restrict__ gate,
                         int m, int n_experts, int dim, int kspan, double* __restrict__ out,
                         int32_t* counters) {
  static_assert((TM / RT) * (TE / RE) == 256, "one output tile per thread");
  constexpr int KC = kRouterKChunk;
  __shared__ __align__(16) float xs[KC][TM + 4];
  __shared__ __align__(16) float ws[KC][TE + 4];
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0)
    counters[2] = 0;  // error flags of this forward (route_finish / plan set them)

  const int tid = threadIdx.x, ty = tid / (TE / RE), tx = tid % (TE / RE);
  const int e0 = blockIdx.x * TE, m0 = blockIdx.y * TM, kbeg = blockIdx.z * kspan;
  float run[RT][RE];
  double acc[RT][RE];
#pragma unroll
  for (int i = 0; i < RT; ++i)
#pragma unroll
    for (int j = 0; j < RE; ++j) run[i][j] = 0.0f, acc[i][j] = 0.0;

  for (int k0 = kbeg; k0 < kbeg + kspan; k0 += KC) {
    __syncthreads();
    for (int i = tid; i < (TM + TE) * (KC / 8); i += 256) {
      const bool is_x = i < TM * (KC / 8);
      const int idx = is_x ? i : i - TM * (KC / 8);
      const int r = idx / (KC / 8), v = idx % (KC / 8);
      const int grow = (is_x ? m0 : e0) + r;
      uint4 q = make_uint4(0, 0, 0, 0);
      if (grow < (is_x ? m : n_experts)) {
        const void* src = is_x ? static_cast<const void*>(x + size_t(grow) * dim + k0 + 8 * v)
                               : static_cast<const void*>(gate + size_t(grow) * dim + k0 + 8 * v);
        q = __ldg(static_cast<const uint4*>(src));
      }
      const uint32_t h[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float lo = num::bf16_lo(h[j] & 0xffffu), hi = num::bf16_lo(h[j] >> 16);
        if (is_x) {
          xs[8 * v + 2 * j][r] = lo;
          xs[8 * v + 2 * j + 1][r] = hi;
        } else {
          ws[8 * v + 2 * j][r] = lo;
          ws[8 * v + 2 * j + 1][r] = hi;
        }
      }
    }
    __syncthreads();
#pragma unroll 4
    for (int kk = 0; kk < KC; ++kk) {
      float av[RT], bv[RE];
#pragma unroll
      for (int i = 0; i < RT; ++i) av[i] = xs[kk][ty * RT + i];
#pragma unroll
      for (int j = 0; j < RE; ++j) bv[j] = ws[kk][tx * RE + j];
#pragma unroll
      for (int i = 0; i < RT; ++i)
#pragma unroll
        for (int j = 0; j < RE; ++j) run[i][j] = fmaf(av[i], bv[j], run[i][j]);
      if (kk % kRouterRun == kRouterRun - 1) {
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
          for (int j = 0; j < RE; ++j) acc[i][j] += double(run[i][j]), run[i][j] = 0.0f;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RT; ++i)
#pragma unroll
    for (int j = 0; j < RE; ++j) {
      const int mm = m0 + ty * RT + i, e = e0 + tx * RE + j;
      if (mm < m && e < n_experts) out[(size_t(blockIdx.z) * m + mm) * n_experts + e] = acc[i][j];
    }
}

// ---- selection, weights and x quantisation: one warp per token ---------------------------
struct FinishArgs {
  const double* logits;
  int ksplit, m, n_experts, top_k;
  const float* bias;       // [E] or null
  const int32_t* tid2eid;  // [vocab, top_k] or null
  int vocab;
  const int32_t* tokens;
  float route_scale;
  bool sigmoid;  // the score function: sigmoid, else sqrt-softplus
  const __nv_bfloat16* x;
  int dim;
  int32_t* sel;
  float* wt;
  __nv_bfloat16* xq;
  int32_t* counters;
};

// FP8 fake-quantisation of one row (dim % 128 == 0) by one warp: lane owns 4 of each block.
__device__ __forceinline__ void quant_row_warp(const __nv_bfloat16* in, __nv_bfloat16* out,
                                               int cols, int lane) {
  for (int b = 0; b < cols; b += kActBlock) {
    const uint2 raw = *reinterpret_cast<const uint2*>(in + b + 4 * lane);
    float v[4] = {num::bf16_lo(raw.x & 0xffffu), num::bf16_lo(raw.x >> 16),
                  num::bf16_lo(raw.y & 0xffffu), num::bf16_lo(raw.y >> 16)};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = num::fp8_scale_from_amax(amax);
    __nv_bfloat162 q0 =
        __floats2bfloat162_rn(num::fp8_fake_quant(v[0], s), num::fp8_fake_quant(v[1], s));
    __nv_bfloat162 q1 =
        __floats2bfloat162_rn(num::fp8_fake_quant(v[2], s), num::fp8_fake_quant(v[3], s));
    uint2 w;
    w.x = *reinterpret_cast<uint32_t*>(&q0);
    w.y = *reinterpret_cast<uint32_t*>(&q1);
    *reinterpret_cast<uint2*>(out + b + 4 * lane) = w;
  }
}

// The score of row r, expert e from its logit, the fp32 rounding of the K splits' double sum:
// sqrt(softplus(logit)) (softplus(x) = x for x > 20, the reference's threshold) or
// sigmoid(logit) = 1 / (1 + exp(-logit)), each in cpu::moe_route's fp32 order.
__device__ __forceinline__ float route_score(const FinishArgs& a, int r, int e) {
  double l = 0.0;
  for (int z = 0; z < a.ksplit; ++z) l += a.logits[(size_t(z) * a.m + r) * a.n_experts + e];
  const float lg = float(l);
  if (a.sigmoid) return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-lg)));
  return sqrtf(lg > 20.0f ? lg : log1pf(expf(lg)));
}

// Selection of row r by one warp from its scores sc[E]: tid2eid or K rounds of a warp argmax
// over score + bias (ties to the lower expert index); weights = score / sum * route_scale,
// summed in selection order as the reference does. `chosen` is K ints of shared memory.
__device__ void select_row(const FinishArgs& a, int r, int lane, const float* sc, int* chosen) {
  const int E = a.n_experts, K = a.top_k;
  if (a.tid2eid) {
    int tok = a.tokens[r];
    if (tok < 0 || tok >= a.vocab) {
      if (lane == 0) atomicOr(&a.counters[2], kErrTokenRange);
      tok = tok < 0 ? 0 : a.vocab - 1;
    }
    if (lane < K) chosen[lane] = a.tid2eid[size_t(tok) * K + lane];
  } else {
    uint32_t taken = 0;  // bit j: this lane's expert lane + 32 j is selected (E <= 1024)
    for (int i = 0; i < K; ++i) {
      float best = -INFINITY;
      int be = 0x7fffffff;
      for (int e = lane, j = 0; e < E; e += 32, ++j) {
        if (taken & (1u << j)) continue;
        const float v = a.bias ? __fadd_rn(sc[e], a.bias[e]) : sc[e];
        if (v > best || be == 0x7fffffff) best = v, be = e;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (ob > best || (ob == best && oe < be) || be == 0x7fffffff) best = ob, be = oe;
      }
      if (lane == 0) chosen[i] = be;
      if (be % 32 == lane) taken |= 1u << (be / 32);
    }
  }
  __syncwarp();
  if (lane == 0) {
    float sum = 0.0f;
    for (int i = 0; i < K; ++i) sum = __fadd_rn(sum, sc[chosen[i]]);
    for (int i = 0; i < K; ++i) {
      a.sel[size_t(r) * K + i] = chosen[i];
      a.wt[size_t(r) * K + i] = __fmul_rn(__fdiv_rn(sc[chosen[i]], sum), a.route_scale);
    }
  }
  __syncwarp();
}

__global__ void __launch_bounds__(32 * kFinishWarps) route_finish_kernel(const FinishArgs a) {
  extern __shared__ float s_score[];  // [warps][E]
  __shared__ int s_chosen[kFinishWarps][kMaxTopK];
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = blockIdx.x * kFinishWarps + warp;
  if (r >= a.m) return;
  float* sc = s_score + warp * a.n_experts;
  for (int e = lane; e < a.n_experts; e += 32) sc[e] = route_score(a, r, e);
  __syncwarp();
  select_row(a, r, lane, sc, s_chosen[warp]);
  quant_row_warp(a.x + size_t(r) * a.dim, a.xq + size_t(r) * a.dim, a.dim, lane);
}

// ---- grouping: one CTA ---------------------------------------------------------------------
struct PlanArgs {
  const int32_t* sel;
  const float* wt;
  int m, top_k, n_experts, tile_n;
  int32_t* counters;
  int32_t* pair_pos;
  int32_t* sorted_row;
  float* sorted_wt;
  int32_t* expert_first;
  int4* tiles;
};

// Exclusive scan of (a, b) over the CTA's threads (kPlanThreads); returns the totals.
__device__ __forceinline__ int2 block_scan2(int a, int b, int2& excl, int2* s_warp) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int ia = a, ib = b;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int ta = __shfl_up_sync(0xffffffffu, ia, o), tb = __shfl_up_sync(0xffffffffu, ib, o);
    if (lane >= o) ia += ta, ib += tb;
  }
  if (lane == 31) s_warp[warp] = make_int2(ia, ib);
  __syncthreads();
  if (warp == 0) {
    int2 w = lane < kPlanThreads / 32 ? s_warp[lane] : make_int2(0, 0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int ta = __shfl_up_sync(0xffffffffu, w.x, o), tb = __shfl_up_sync(0xffffffffu, w.y, o);
      if (lane >= o) w.x += ta, w.y += tb;
    }
    if (lane < kPlanThreads / 32) s_warp[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int2 before = warp > 0 ? s_warp[warp - 1] : make_int2(0, 0);
  excl = make_int2(before.x + ia - a, before.y + ib - b);
  const int2 total = s_warp[kPlanThreads / 32 - 1];
  __syncthreads();
  return total;
}

// The grouping by one CTA of kPlanThreads threads (sel/wt written before, visible to it).
__device__ void plan_body(const PlanArgs& a) {
  __shared__ int s_cnt[kMaxExperts], s_first[kMaxExperts];
  __shared__ int2 s_warp[kPlanThreads / 32];
  const int tid = threadIdx.x, E = a.n_experts, K = a.top_k, n = a.m * K;
  for (int e = tid; e < kMaxExperts; e += kPlanThreads) s_cnt[e] = 0;
  __syncthreads();
  // Rank of each (row, slot) within its expert; a repeated expert in a row counts once.
  for (int p = tid; p < n; p += kPlanThreads) {
    const int r = p / K, i = p % K, e = a.sel[p];
    bool skip = e < 0 || e >= E;
    if (skip) atomicOr(&a.counters[2], kErrExpertRange);
    for (int j = 0; j < i && !skip; ++j) skip = a.sel[size_t(r) * K + j] == e;
    a.pair_pos[p] = skip ? -1 : atomicAdd(&s_cnt[e], 1);
  }
  __syncthreads();
  const int c = tid < E ? s_cnt[tid] : 0;
  const int nt = (c + a.tile_n - 1) / a.tile_n;
  int2 excl;
  const int2 total = block_scan2(c, nt, excl, s_warp);
  if (tid < E) s_first[tid] = excl.x;
  __syncthreads();
  for (int p = tid; p < n; p += kPlanThreads) {
    const int rank = a.pair_pos[p];
    if (rank < 0) continue;
    const int pos = s_first[a.sel[p]] + rank;
    a.pair_pos[p] = pos;
    a.sorted_row[pos] = p / K;
    a.sorted_wt[pos] = a.wt[p];
  }
  if (tid < E) {
    a.expert_first[tid] = excl.x;
    for (int j = 0; j < nt; ++j)
      a.tiles[excl.y + j] =
          make_int4(tid, excl.x + j * a.tile_n, min(a.tile_n, c - j * a.tile_n), 0);
  }
  if (tid == 0) {
    a.expert_first[E] = total.x;
    a.counters[0] = total.x;
    a.counters[1] = total.y;
  }
}

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(const PlanArgs a) {
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  plan_body(a);
}

// Decode: selection of every row and the grouping in one CTA. Scores of all rows first (all
// threads, so the K-split partial sums are read in parallel), then one warp per row selects
// and quantises x, then the grouping.
__global__ void __launch_bounds__(kPlanThreads)
    route_plan_small_kernel(const FinishArgs f, const PlanArgs p) {
  extern __shared__ float s_scores[];  // [m][E]
  __shared__ int s_chosen[kPlanThreads / 32][kMaxTopK];
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < f.m * f.n_experts; i += kPlanThreads)
    s_scores[i] = route_score(f, i / f.n_experts, i % f.n_experts);
  __syncthreads();
  for (int r = warp; r < f.m; r += kPlanThreads / 32) {
    select_row(f, r, lane, s_scores + size_t(r) * f.n_experts, s_chosen[warp]);
    quant_row_warp(f.x + size_t(r) * f.dim, f.xq + size_t(r) * f.dim, f.dim, lane);
  }
  __syncthreads();  // sel / wt (global) written by this CTA are visible to all its threads
  plan_body(p);
}

// ---- FP8 fake-quantisation of the first counters[0] rows: one warp per row -----------------
__global__ void __launch_bounds__(256)
    quant_rows_kernel(const __nv_bfloat16* in, __nv_bfloat16* out, int max_rows, int cols,
                      const int32_t* counters) {
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int r = blockIdx.x * 8 + threadIdx.x / 32;
  if (r >= max_rows || r >= counters[0]) return;
  quant_row_warp(in + size_t(r) * cols, out + size_t(r) * cols, cols, threadIdx.x % 32);
}

// ---- combine: one CTA per token row ----------------------------------------------------------
__global__ void __launch_bounds__(256)
    combine_kernel(const int32_t* sel, const int32_t* pair_pos, int top_k, const __nv_bfloat16* ye,
                   const __nv_bfloat16* shared, __nv_bfloat16* y, int dim) {
  __shared__ int s_pos[kMaxTopK];
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int r = blockIdx.x;
  if (threadIdx.x < top_k) {
    // Slot i's rank in ascending expert index (stable); repeated experts have pos -1.
    const int i = threadIdx.x, e = sel[size_t(r) * top_k + i];
    int rank = 0;
    for (int j = 0; j < top_k; ++j) {
      const int f = sel[size_t(r) * top_k + j];
      rank += f < e || (f == e && j < i);
    }
    s_pos[rank] = pair_pos[size_t(r) * top_k + i];
  }
  __syncthreads();
  for (int c = threadIdx.x * 8; c < dim; c += blockDim.x * 8) {
    float acc[8] = {};
    for (int i = 0; i < top_k; ++i) {
      const int pos = s_pos[i];
      if (pos < 0) continue;
      const uint4 v = *reinterpret_cast<const uint4*>(ye + size_t(pos) * dim + c);
      const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[2 * j] = __fadd_rn(acc[2 * j], num::bf16_lo(h[j] & 0xffffu));
        acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], num::bf16_lo(h[j] >> 16));
      }
    }
    uint32_t sh[4] = {0, 0, 0, 0};
    if (shared) {
      const uint4 v = *reinterpret_cast<const uint4*>(shared + size_t(r) * dim + c);
      sh[0] = v.x, sh[1] = v.y, sh[2] = v.z, sh[3] = v.w;
    }
    uint32_t o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      __nv_bfloat162 b =
          __floats2bfloat162_rn(__fadd_rn(acc[2 * j], num::bf16_lo(sh[j] & 0xffffu)),
                                __fadd_rn(acc[2 * j + 1], num::bf16_lo(sh[j] >> 16)));
      o[j] = *reinterpret_cast<uint32_t*>(&b);
    }
    *reinterpret_cast<uint4*>(y + size_t(r) * dim + c) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

}  // namespace

void launch_router_logits(const LaunchCtx& c, const __nv_bfloat16* x, const uint16_t* gate, int m,
                          int n_experts, int dim, int ksplit, double* out, int32_t* counters) {
  const int kspan = dim / ksplit;
  auto run = [&](auto kernel, int tm, int te) {
    const dim3 grid((n_experts + te - 1) / te, (m + tm - 1) / tm, ksplit);
    launch_kernel(c, kernel, grid, dim3(256), 0, x, gate, m, n_experts, dim, kspan, out, counters);
  };
  if (m <= kRouterSmallTM)
    run(router_logits_kernel<kRouterSmallTM, kRouterSmallTE, 1, 1>, kRouterSmallTM, kRouterSmallTE);
  else if (m <= kRouterMidTM)
    run(router_logits_kernel<kRouterMidTM, kRouterMidTE, 1, 1>, kRouterMidTM, kRouterMidTE);
  else
    run(router_logits_kernel<kRouterLargeTM, kRouterLargeTE, 4, 4>, kRouterLargeTM, kRouterLargeTE);
}

namespace {

FinishArgs finish_args(const MoeDeviceWeights& w, const MoeArgs& a, const MoeWorkspace& ws) {
  FinishArgs f;
  f.logits = ws.logits;
  f.ksplit = ws.ksplit;
  f.m = a.m;
  f.n_experts = w.n_experts;
  f.top_k = a.p.top_k;
  f.bias = w.bias.size() ? w.bias.data() : nullptr;
  f.tid2eid = w.hash() ? w.tid2eid.data() : nullptr;
  f.vocab = w.vocab;
  f.tokens = a.tokens;
  f.route_scale = a.p.route_scale;
  f.sigmoid = a.p.score_func == ScoreFunc::kSigmoid;
  f.x = a.x;
  f.dim = w.dim;
  f.sel = ws.sel;
  f.wt = ws.wt;
  f.xq = ws.xq;
  f.counters = ws.counters;
  return f;
}

PlanArgs plan_args(const MoeDeviceWeights& w, const MoeArgs& a, const MoeWorkspace& ws,
                   int tile_n) {
  PlanArgs p;
  p.sel = ws.sel;
  p.wt = ws.wt;
  p.m = a.m;
  p.top_k = a.p.top_k;
  p.n_experts = w.n_experts;
  p.tile_n = tile_n;
  p.counters = ws.counters;
  p.pair_pos = ws.pair_pos;
  p.sorted_row = ws.sorted_row;
  p.sorted_wt = ws.sorted_wt;
  p.expert_first = ws.expert_first;
  p.tiles = ws.tiles;
  return p;
}

}  // namespace

bool route_plan_fused(int m, int n_experts) {
  return m <= kFusedRouteRows && size_t(m) * n_experts * sizeof(float) <= kFusedRouteSmem;
}

void launch_route_finish(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                         const MoeWorkspace& ws) {
  const size_t smem = size_t(kFinishWarps) * w.n_experts * sizeof(float);
  launch_kernel(c, route_finish_kernel, dim3((a.m + kFinishWarps - 1) / kFinishWarps),
                dim3(32 * kFinishWarps), smem, finish_args(w, a, ws));
}

void launch_plan(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                 const MoeWorkspace& ws, int tile_n) {
  launch_kernel(c, plan_kernel, dim3(1), dim3(kPlanThreads), 0, plan_args(w, a, ws, tile_n));
}

void launch_route_plan_small(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                             const MoeWorkspace& ws, int tile_n) {
  static std::atomic<uint64_t> attr{0};
  once_per_device(attr, [] {
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(route_plan_small_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(kFusedRouteSmem)));
  });
  const size_t smem = size_t(a.m) * w.n_experts * sizeof(float);
  launch_kernel(c, route_plan_small_kernel, dim3(1), dim3(kPlanThreads), smem,
                finish_args(w, a, ws), plan_args(w, a, ws, tile_n));
}

void launch_quant_rows(const LaunchCtx& c, const __nv_bfloat16* in, __nv_bfloat16* out,
                       int max_rows, int cols, const int32_t* counters) {
  if (max_rows == 0) return;
  launch_kernel(c, quant_rows_kernel, dim3((max_rows + 7) / 8), dim3(256), 0, in, out, max_rows,
                cols, counters);
}

void launch_combine(const LaunchCtx& c, const MoeWorkspace& ws, int m, int top_k,
                    const __nv_bfloat16* shared, __nv_bfloat16* y, int dim) {
  launch_kernel(c, combine_kernel, dim3(m), dim3(256), 0, static_cast<const int32_t*>(ws.sel),
                static_cast<const int32_t*>(ws.pair_pos), top_k,
                static_cast<const __nv_bfloat16*>(ws.ye), shared, y, dim);
}

}  // namespace dsv4::cuda::moe
