// MoE kernels around the expert GEMMs: router logits, top-k / hash selection with the x
// quantisation, grouping by expert, FP8 fake-quantisation of rows, combine.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cmath>

#include "core/error.h"
#include "ops/cuda/common/numerics.cuh"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/moe/combine_order.cuh"
#include "ops/cuda/moe/moe.h"
#include "ops/cuda/moe/moe_config.h"
#include "ops/cuda/moe/moe_kernels.h"

namespace dsv4::cuda::moe {
namespace {

namespace cg = cooperative_groups;

// ---- router: logits, scores and the x quantisation ----------------------------------------
// logit[m][e] = fp32 of the double sum of x[m][k] * gate[e][k]: the products of two BF16 values
// are exact in double and the sum's rounding error (~2^-45 of sum |x g|) is far below an fp32
// ulp, so the logit equals cpu::linear's (exact products summed in double, rounded once)
// unless the two double sums straddle an fp32 rounding boundary (~1e-7 per logit). Each logit
// is summed by one CTA in a fixed order: no split partials, no atomics, run-to-run identical.
struct RouterArgs {
  const __nv_bfloat16* x;  // [m, dim]
  const uint16_t* gate;    // BF16 bits [E, dim]
  int m, n_experts, dim;
  bool sigmoid;       // the score function: sigmoid, else sqrt-softplus
  float* logits;      // [m, E]
  float* scores;      // [m, E]
  __nv_bfloat16* xq;  // [m, dim]
  int32_t* counters;
};

// BF16 element h (0..7; a constant once unrolled) of 8 packed in a 16-byte load, as a double.
__device__ __forceinline__ double bf16_elem_double(const uint4& v, int h) {
  const uint32_t w = (&v.x)[h / 2];
  return double(h % 2 ? num::bf16_hi(w) : num::bf16_lo(w));
}

// The score of a logit in cpu::moe_route's fp32 formula, each fp32 operation correctly rounded
// (exp and log1p in double, then rounded): sqrt(softplus(l)), softplus(l) = l for l > 20 (the
// reference's threshold), else log1p(exp(l)); or sigmoid(l) = 1 / (1 + exp(-l)).
__device__ __forceinline__ float route_score(float lg, bool sigmoid) {
  if (sigmoid) return __fdiv_rn(1.0f, __fadd_rn(1.0f, __double2float_rn(exp(-double(lg)))));
  if (lg > 20.0f) return __fsqrt_rn(lg);
  const float e = __double2float_rn(exp(double(lg)));
  return __fsqrt_rn(__double2float_rn(log1p(double(e))));
}

__device__ __forceinline__ void store_logit(const RouterArgs& a, int r, int e, double sum) {
  const float lg = __double2float_rn(sum);
  a.logits[size_t(r) * a.n_experts + e] = lg;
  a.scores[size_t(r) * a.n_experts + e] = route_score(lg, a.sigmoid);
}

// FP8 fake-quantisation of one 128-block of a row by one warp from the lane's 4 values
// (raw: BF16 pairs of in[4 lane .. 4 lane + 4)).
__device__ __forceinline__ void quant_block_warp_raw(uint2 raw, __nv_bfloat16* out, int lane) {
  *reinterpret_cast<uint2*>(out + 4 * lane) = num::fp8_fake_quant_warp128(raw);
}

// FP8 fake-quantisation of one 128-block held by an aligned half-warp, 8 values a lane (raw:
// BF16 pairs of in[8 (lane % 16) .. + 8)); the same amax, scale and values as
// quant_block_warp_raw. Called by the whole warp; only lanes with `valid` (uniform over each
// half-warp) store.
__device__ __forceinline__ void quant_block_halfwarp_raw(uint4 raw, __nv_bfloat16* out,
                                                         bool valid) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  float v[8];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    v[2 * j] = num::bf16_lo(w[j] & 0xffffu), v[2 * j + 1] = num::bf16_lo(w[j] >> 16);
  float amax = fabsf(v[0]);  // the same fmaxf folds as the warp version (NaN-ignoring alike)
#pragma unroll
  for (int j = 1; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!valid) return;
  const float s = num::fp8_scale_from_amax(amax);
  uint32_t q[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    __nv_bfloat162 b = __floats2bfloat162_rn(num::fp8_fake_quant(v[2 * j], s),
                                             num::fp8_fake_quant(v[2 * j + 1], s));
    q[j] = *reinterpret_cast<uint32_t*>(&b);
  }
  *reinterpret_cast<uint4*>(out) = make_uint4(q[0], q[1], q[2], q[3]);
}

// The x quantisation of rows [r0, r0 + rows): its (row, 128-block) items spread over the warps
// of the CTAs that share this row tile (blockIdx.x, blockIdx.z), so every CTA does a little.
__device__ __forceinline__ void quant_rows_share(const RouterArgs& a, int r0, int rows) {
  constexpr int B = 4;  // items whose loads are in flight together
  const int nb = a.dim / kActBlock, warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int cta = blockIdx.z * gridDim.x + blockIdx.x, stride = gridDim.z * gridDim.x * warps;
  const int items = rows * nb;
  for (int i0 = cta * warps + threadIdx.x / 32; i0 < items; i0 += B * stride) {
    uint2 raw[B];
#pragma unroll
    for (int q = 0; q < B; ++q) {
      const int i = i0 + q * stride;
      const size_t off = size_t(r0 + i / nb) * a.dim + size_t(i % nb) * kActBlock;
      raw[q] = i < items ? *reinterpret_cast<const uint2*>(a.x + off + 4 * lane) : make_uint2(0, 0);
    }
#pragma unroll
    for (int q = 0; q < B; ++q) {
      const int i = i0 + q * stride;
      if (i < items)  // warp-uniform
        quant_block_warp_raw(raw[q],
                             a.xq + size_t(r0 + i / nb) * a.dim + size_t(i % nb) * kActBlock, lane);
    }
  }
}

// The gate rows [e0, e0 + ne) x k [k0, k0 + klen) that this CTA reads are prefetched into L2
// before the wait for the previous kernel (the gate is a weight: nothing in the stream writes
// it), so their DRAM latency overlaps that kernel's tail; the loads then find them in L2 or in
// flight. Values and sums are unchanged.
__device__ __forceinline__ void router_prologue(const RouterArgs& a, int e0, int ne, int k0,
                                                int klen) {
  ne = min(ne, a.n_experts - e0);
  const int lines = klen / 64;  // 128-byte lines of BF16 per gate row (klen % 64 == 0)
  for (int i = threadIdx.x; i < ne * lines; i += blockDim.x) {
    const uint16_t* p = a.gate + size_t(e0 + i / lines) * a.dim + k0 + 64 * (i % lines);
    asm volatile("prefetch.L2 [%0];" ::"l"(p));  // generic address
  }
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0)
    a.counters[2] = 0;  // error flags of this forward (selection / plan set them)
}

// Decode (RT rows x TE experts per CTA): every thread sums its 8-wide K chunks t, t + 256, ...
// for all RT x TE outputs in registers (U chunks' loads in flight at once), then the CTA adds
// the 256 partial sums of each output in a fixed binary tree.
template <int RT, int TE, int U>
__global__ void __launch_bounds__(256) router_gemv_kernel(const RouterArgs a) {
  constexpr int N = RT * TE, P = N < 16 ? N : 16;  // outputs; reduced P at a time
  __shared__ double s_sum[N];
  const int tid = threadIdx.x, e0 = blockIdx.x * TE, r0 = blockIdx.y * RT;
  const int rows = min(RT, a.m - r0);
  router_prologue(a, e0, TE, 0, a.dim);
  const int nchunk = a.dim / 8;
  const uint4* xg = reinterpret_cast<const uint4*>(a.x);
  const uint4* gg = reinterpret_cast<const uint4*>(a.gate);
  double acc[N];
#pragma unroll
  for (int o = 0; o < N; ++o) acc[o] = 0.0;
  // The loop bound is CTA-uniform (base, not tid): the x quantisation below shuffles across
  // full warps, so every lane must run every iteration even where dim / 8 < 256 chunks (lanes
  // past the end load zeros, which add +0 to their sums: the same bits as not running).
  for (int base = 0; base < nchunk; base += 256 * U) {
    const int c0 = base + tid;
    uint4 xv[U][RT], gv[U][TE];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 256 * u;
#pragma unroll
      for (int i = 0; i < RT; ++i)
        xv[u][i] =
            c < nchunk && i < rows ? xg[size_t(r0 + i) * nchunk + c] : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < TE; ++j)
        gv[u][j] = c < nchunk && e0 + j < a.n_experts ? __ldg(gg + size_t(e0 + j) * nchunk + c)
                                                      : make_uint4(0, 0, 0, 0);
    }
    if (blockIdx.x == 0) {  // this row tile's x quantisation, from the registers: 16 lanes hold
                            // one 128-block (chunks 16 b .. 16 b + 15; dim % 128 == 0)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int i = 0; i < RT; ++i) {
          const int c = c0 + 256 * u;
          if (i < rows)  // CTA-uniform
            quant_block_halfwarp_raw(xv[u][i], a.xq + size_t(r0 + i) * a.dim + size_t(c) * 8,
                                     c < nchunk);
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 8; ++h) {
        double xd[RT], gd[TE];
#pragma unroll
        for (int i = 0; i < RT; ++i) xd[i] = bf16_elem_double(xv[u][i], h);
#pragma unroll
        for (int j = 0; j < TE; ++j) gd[j] = bf16_elem_double(gv[u][j], h);
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
          for (int j = 0; j < TE; ++j) acc[i * TE + j] = fma(xd[i], gd[j], acc[i * TE + j]);
      }
  }
  if constexpr (N <= 8) {
    // A butterfly per output in each warp (every lane ends with the same bits: a + b = b + a),
    // then the 8 warps in order.
    __shared__ double s_warp[8][N];
#pragma unroll
    for (int o = 0; o < N; ++o)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[o] += __shfl_xor_sync(0xffffffffu, acc[o], off);
    if (tid % 32 == 0)
#pragma unroll
      for (int o = 0; o < N; ++o) s_warp[tid / 32][o] = acc[o];
    __syncthreads();
    if (tid < N) {
      double sum = s_warp[0][tid];
#pragma unroll
      for (int w = 1; w < 8; ++w) sum += s_warp[w][tid];
      s_sum[tid] = sum;
    }
  } else {
    // P outputs at a time: the 256 partial sums of each in a fixed binary tree.
    __shared__ double s_red[P * 256];
#pragma unroll
    for (int base = 0; base < N; base += P) {
      __syncthreads();
#pragma unroll
      for (int v = 0; v < P; ++v) s_red[v * 256 + tid] = acc[base + v];
      for (int half = 128; half > 0; half >>= 1) {
        __syncthreads();
        for (int i = tid; i < P * half; i += 256) {
          const int v = i / half, t = i % half;
          s_red[v * 256 + t] += s_red[v * 256 + t + half];
        }
      }
      __syncthreads();
      if (tid < P) s_sum[base + tid] = s_red[tid * 256];
    }
  }
  __syncthreads();
  if (tid < N) {  // the scores of all outputs in parallel (fp64 exp / log1p: long latency)
    const int i = tid / TE, j = tid % TE;
    if (i < rows && e0 + j < a.n_experts) store_logit(a, r0 + i, e0 + j, s_sum[tid]);
  }
}

// fp64 tensor-core MMA (m8n8k4, exact products, fp64 sums): D[8 rows][8 experts] += A B.
__device__ __forceinline__ void dmma_8x8x4(double& c0, double& c1, double a, double b) {
  asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
      : "+d"(c0), "+d"(c1)
      : "d"(a), "d"(b));
}

// 8 MT rows x 8 NT experts per CTA on fp64 tensor cores; K split over the kRouterCluster CTAs
// of a cluster (blockIdx.z) and over the 8 warps of each. A warp multiplies 32-wide k-blocks:
// lane (g = lane / 4, t = lane % 4) loads 8 consecutive k of x rows 8 i + g and of experts
// 8 j + g, and step s of the block feeds k = 8 t + s as the MMA's k index t (any bijection of k
// works: both operands use the same one). Each BF16 value is converted to fp64 once per warp
// and used by NT (x) or MT (gate) MMAs. Partial sums: warps added in warp order in shared
// memory, then the cluster's CTAs in rank order through distributed shared memory, each CTA
// finishing 1/kRouterCluster of the outputs (logit, score).
template <int MT, int NT>
__global__ void __cluster_dims__(1, 1, kRouterCluster) __launch_bounds__(256)
    router_mma_kernel(const RouterArgs a) {
  constexpr int TM = 8 * MT, TE = 8 * NT, N = TM * TE, CS = kRouterCluster;
  constexpr int U = 12 / (MT + NT) > 0 ? 12 / (MT + NT) : 1;  // k-blocks' loads in flight
  __shared__ double s_red[8][N];
  __shared__ double s_cta[N];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int e0 = blockIdx.x * TE, r0 = blockIdx.y * TM;
  const int rows = min(TM, a.m - r0);
  const int kspan = a.dim / CS, kbeg = blockIdx.z * kspan, nkb = kspan / 32;
  router_prologue(a, e0, TE, kbeg, kspan);
  double c[MT][NT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) c[i][j][0] = c[i][j][1] = 0.0;
  for (int kb0 = warp; kb0 < nkb; kb0 += 8 * U) {
    uint4 xv[U][MT], gv[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kb = kb0 + 8 * u, k = kbeg + 32 * kb + 8 * t;
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int r = 8 * i + g;
        xv[u][i] = kb < nkb && r < rows
                       ? *reinterpret_cast<const uint4*>(a.x + size_t(r0 + r) * a.dim + k)
                       : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int e = e0 + 8 * j + g;
        gv[u][j] = kb < nkb && e < a.n_experts
                       ? __ldg(reinterpret_cast<const uint4*>(a.gate + size_t(e) * a.dim + k))
                       : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 8; ++h) {
        double av[MT], bv[NT];
#pragma unroll
        for (int i = 0; i < MT; ++i) av[i] = bf16_elem_double(xv[u][i], h);
#pragma unroll
        for (int j = 0; j < NT; ++j) bv[j] = bf16_elem_double(gv[u][j], h);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int j = 0; j < NT; ++j) dmma_8x8x4(c[i][j][0], c[i][j][1], av[i], bv[j]);
      }
  }
  quant_rows_share(a, r0, rows);
  // Output o = row * TE + expert column; the lane holds rows 8 i + g, columns 8 j + 2 t + {0, 1}.
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s_red[warp][(8 * i + g) * TE + 8 * j + 2 * t] = c[i][j][0];
      s_red[warp][(8 * i + g) * TE + 8 * j + 2 * t + 1] = c[i][j][1];
    }
  __syncthreads();
  for (int o = threadIdx.x; o < N; o += 256) {
    double sum = s_red[0][o];
#pragma unroll
    for (int w = 1; w < 8; ++w) sum += s_red[w][o];
    s_cta[o] = sum;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int rank = int(cluster.block_rank());
  for (int o = rank * (N / CS) + threadIdx.x; o < (rank + 1) * (N / CS); o += 256) {
    double sum = *cluster.map_shared_rank(s_cta + o, 0);
#pragma unroll
    for (int q = 1; q < CS; ++q) sum += *cluster.map_shared_rank(s_cta + o, q);
    const int i = o / TE, e = e0 + o % TE;
    if (i < rows && e < a.n_experts) store_logit(a, r0 + i, e, sum);
  }
  cluster.sync();  // no CTA leaves while another still reads its s_cta
}

// fp64 tensor-core MMA m16n8k16 (sm_90; the m8n8k4 shape runs at half the fp64 tensor rate):
// D[16 rows][8 experts] += A B. Lane (g, t) holds A rows g (a[2 q]) and g + 8 (a[2 q + 1]) and B
// column g (b[q]) at k index t + 4 q; D rows g (d[0], d[1]) and g + 8 (d[2], d[3]), columns 2 t,
// 2 t + 1.
__device__ __forceinline__ void dmma_16x8x16(double (&d)[4], const double (&a)[8],
                                             const double (&b)[4]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, {%0, %1, %2, %3};"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
        "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
}

// Prefill (TM rows x TE experts per CTA) on fp64 tensor cores, straight from registers (no
// shared memory, no barriers): warp w owns rows 32 (w / WE) .. +31 and experts 32 (w % WE) ..
// +31, 2 x 4 m16n8k16 tiles. Per 32-wide k-block lane (g, t) loads 8 consecutive k of x rows
// 8 i + g and of experts 8 j + g; step s feeds elements s .. s + 3 as the MMA's k indices
// t, t + 4, t + 8, t + 12 (router_mma_kernel's bijection, both operands alike); each BF16 value is
// converted once per warp and used by 4 (x) or 2 (gate) MMAs. The next k-block's 8 loads are in
// flight while this one is multiplied; the warps of a CTA share x and gate rows through L1.
// Every output is summed over K in order by one warp (no K splits, no partials).
// History (H200, route stage alone, Flash M = 4096): per-thread fp64 FMAs 906 us; m8n8k4 MMAs on
// 64 x 64 tiles staged in shared memory as doubles 494 us (bound by the stores, the fragment
// loads and two barriers per k chunk); from registers with m8n8k4 391 us (m8n8k4 runs at half
// of sm_90's fp64 tensor rate: one CTA alone took 296 us), m16n8k4 317, m16n8k8 293, m16n8k16
// 291 (Pro 878, router_mma 1121).
template <int TM, int TE>
__global__ void __launch_bounds__(256) router_tiled_kernel(const RouterArgs a) {
  constexpr int WM = TM / 32, WE = TE / 32;
  static_assert(WM * WE == 8, "8 warps of 32 rows x 32 experts");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int e0 = blockIdx.x * TE, m0 = blockIdx.y * TM;
  const int wr = m0 + 32 * (warp / WE), we = e0 + 32 * (warp % WE);
  router_prologue(a, 0, 0, 0, 0);  // prefill: no prefetch
  // x rows 8 i + g (i = 2 m + h: m16 tile m, half h), experts 8 j + g, k = 8 t .. 8 t + 7.
  const __nv_bfloat16* xp[4];
  const uint16_t* gp[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = wr + 8 * i + g, e = we + 8 * i + g;
    xp[i] = r < a.m ? a.x + size_t(r) * a.dim + 8 * t : nullptr;
    gp[i] = e < a.n_experts ? a.gate + size_t(e) * a.dim + 8 * t : nullptr;
  }
  uint4 xv[4], gv[4];
  auto load = [&](int k) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      xv[i] = xp[i] ? *reinterpret_cast<const uint4*>(xp[i] + k) : make_uint4(0, 0, 0, 0);
      gv[i] = gp[i] ? __ldg(reinterpret_cast<const uint4*>(gp[i] + k)) : make_uint4(0, 0, 0, 0);
    }
  };
  double c[2][4][4] = {};
  load(0);
  for (int k0 = 0; k0 < a.dim; k0 += 32) {
    const uint4 xc[4] = {xv[0], xv[1], xv[2], xv[3]};
    const uint4 gc[4] = {gv[0], gv[1], gv[2], gv[3]};
    if (k0 + 32 < a.dim) load(k0 + 32);
#pragma unroll
    for (int s = 0; s < 8; s += 4) {
      // Elements s .. s + 3 of the lane's 8 as k indices t, t + 4, t + 8, t + 12: every k of
      // the block once, the same bijection for x and the gate.
      double av[2][8], bv[4][4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          av[m][2 * q] = bf16_elem_double(xc[2 * m], s + q);
          av[m][2 * q + 1] = bf16_elem_double(xc[2 * m + 1], s + q);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[j][q] = bf16_elem_double(gc[j], s + q);
      }
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) dmma_16x8x16(c[m][j], av[m], bv[j]);
    }
  }
  quant_rows_share(a, m0, min(TM, a.m - m0));
  // Accumulator c[m][j][q]: row 16 m + g (+ 8 for q >= 2), expert 8 j + 2 t + q % 2.
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int mm = wr + 16 * m + g + 8 * (q / 2), e = we + 8 * j + 2 * t + q % 2;
        if (mm < a.m && e < a.n_experts) store_logit(a, mm, e, c[m][j][q]);
      }
}

// ---- selection and weights ------------------------------------------------------------------
struct SelectArgs {
  const float* scores;  // [m, E]
  int m, n_experts, top_k;
  const float* bias;       // [E] or null
  const int32_t* tid2eid;  // [vocab, top_k] or null
  int vocab;
  const int32_t* tokens;
  float route_scale;
  int32_t* sel;
  float* wt;
  int32_t* counters;
};

// Selection of row r by one warp from its biased scores b[E] (score + bias in fp32, as
// cpu::moe_route): tid2eid, or K rounds of a warp argmax (ties to the lower expert index: the
// CPU's partial_sort order); weights = score / sum * route_scale with the sum in selection
// order. Writes sel / wt of the row to global memory and to sel_out / wt_out (K each). raw:
// the row's scores staged in shared memory, or null (read from a.scores).
__device__ __forceinline__ void select_row(const SelectArgs& a, int r, int lane, const float* b,
                                           const float* raw, int32_t* sel_out, float* wt_out) {
  const int E = a.n_experts, K = a.top_k;
  int chosen = 0;  // lane i < K: the i-th selected expert
  if (a.tid2eid) {
    int tok = a.tokens[r];
    if (tok < 0 || tok >= a.vocab) {
      if (lane == 0) atomicOr(&a.counters[2], kErrTokenRange);
      tok = tok < 0 ? 0 : a.vocab - 1;
    }
    if (lane < K) chosen = a.tid2eid[size_t(tok) * K + lane];
  } else {
    uint32_t taken = 0;  // bit j: this lane's expert lane + 32 j is selected (E <= 1024)
    for (int i = 0; i < K; ++i) {
      float best = -INFINITY;
      int be = 0x7fffffff;
      for (int e = lane, j = 0; e < E; e += 32, ++j) {
        if (taken & (1u << j)) continue;
        const float v = b[e];
        if (v > best || be == 0x7fffffff) best = v, be = e;
      }
      // The warp's argmax in two reductions (REDUX, not 5 dependent shuffle steps): the largest
      // value as order-preserving bits (-0 as +0, so equal values stay equal as in the CPU's
      // sort), then the lowest expert index holding it. A lane without a candidate offers key 0
      // (below every value but a NaN) and no index. Scores are NaN-free.
      const uint32_t bits = __float_as_uint(best == 0.0f ? 0.0f : best);
      const uint32_t key =
          be == 0x7fffffff ? 0u : (bits & 0x80000000u ? ~bits : bits | 0x80000000u);
      const uint32_t kmax = __reduce_max_sync(0xffffffffu, key);
      be = int(__reduce_min_sync(0xffffffffu,
                                 be != 0x7fffffff && key == kmax ? uint32_t(be) : 0x7fffffffu));
      if (lane == i) chosen = be;
      if (be % 32 == lane) taken |= 1u << (be / 32);
    }
  }
  const bool ok = chosen >= 0 && chosen < E;  // tid2eid ids were range-checked at upload
  const float sc = lane < K && ok ? (raw ? raw[chosen] : a.scores[size_t(r) * E + chosen]) : 0.0f;
  float sum = 0.0f;
  for (int i = 0; i < K; ++i) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, sc, i));
  if (lane < K) {
    const float w = __fmul_rn(__fdiv_rn(sc, sum), a.route_scale);
    a.sel[size_t(r) * K + lane] = chosen;
    a.wt[size_t(r) * K + lane] = w;
    sel_out[lane] = chosen;
    wt_out[lane] = w;
  }
}

// Biased scores of row r into b[E] by the calling warp (plain scores for hash rows: unused).
__device__ __forceinline__ void load_biased(const SelectArgs& a, int r, int lane, float* b) {
  if (a.tid2eid) return;
  const float* s = a.scores + size_t(r) * a.n_experts;
  for (int e = lane; e < a.n_experts; e += 32) b[e] = a.bias ? __fadd_rn(s[e], a.bias[e]) : s[e];
}

__global__ void __launch_bounds__(32 * kFinishWarps) route_select_kernel(const SelectArgs a) {
  extern __shared__ float s_biased[];  // [warps][E]
  __shared__ int32_t s_sel[kFinishWarps][kMaxTopK];
  __shared__ float s_wt[kFinishWarps][kMaxTopK];
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = blockIdx.x * kFinishWarps + warp;
  if (r >= a.m) return;
  float* b = s_biased + warp * a.n_experts;
  load_biased(a, r, lane, b);
  __syncwarp();
  select_row(a, r, lane, b, nullptr, s_sel[warp], s_wt[warp]);
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
  int32_t* chunk_counts;  // multi-CTA grouping: [chunks, E]
};

// Rank of pair p within its expert by a shared-memory counter, or -1 for a repeated expert in
// its row (counted once) and an expert id out of range (flagged).
__device__ __forceinline__ int pair_rank(const PlanArgs& a, const int32_t* sel, int p, int* s_cnt) {
  const int K = a.top_k, r = p / K, i = p % K, e = sel[p];
  bool skip = e < 0 || e >= a.n_experts;
  if (skip) atomicOr(&a.counters[2], kErrExpertRange);
  for (int j = 0; j < i && !skip; ++j) skip = sel[size_t(r) * K + j] == e;
  return skip ? -1 : atomicAdd(&s_cnt[e], 1);
}

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

// The experts' first positions and tiles from their counts c (thread e < E; every thread of the
// CTA calls it: a block scan).
__device__ __forceinline__ void write_groups(const PlanArgs& a, int c, int2* s_warp, int* s_first) {
  const int tid = threadIdx.x, E = a.n_experts;
  const int nt = (c + a.tile_n - 1) / a.tile_n;
  int2 excl;
  const int2 total = block_scan2(c, nt, excl, s_warp);
  if (tid < E) {
    if (s_first) s_first[tid] = excl.x;
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

// The grouping by one CTA of kPlanThreads threads from sel / wt ([m, K], global or shared,
// written before and visible to the CTA).
__device__ void plan_body(const PlanArgs& a, const int32_t* sel, const float* wt) {
  __shared__ int s_cnt[kMaxExperts], s_first[kMaxExperts];
  __shared__ int2 s_warp[kPlanThreads / 32];
  const int tid = threadIdx.x, E = a.n_experts, K = a.top_k, n = a.m * K;
  for (int e = tid; e < kMaxExperts; e += kPlanThreads) s_cnt[e] = 0;
  __syncthreads();
  // Rank of each (row, slot) within its expert; a repeated expert in a row counts once.
  for (int p = tid; p < n; p += kPlanThreads) a.pair_pos[p] = pair_rank(a, sel, p, s_cnt);
  __syncthreads();
  write_groups(a, tid < E ? s_cnt[tid] : 0, s_warp, s_first);
  __syncthreads();
  for (int p = tid; p < n; p += kPlanThreads) {
    const int rank = a.pair_pos[p];
    if (rank < 0) continue;
    const int pos = s_first[sel[p]] + rank;
    a.pair_pos[p] = pos;
    a.sorted_row[pos] = p / K;
    a.sorted_wt[pos] = wt[p];
  }
}

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(const PlanArgs a) {
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  plan_body(a, a.sel, a.wt);
}

// ---- grouping over many CTAs (pairs >= kPlanMultiMinPairs) -------------------------------------
// 1. count: CTA b ranks the pairs of its chunk within their experts (pair_pos = the rank in the
//    chunk) and writes its per-expert counts. 2. scan (one CTA, a thread per expert): the counts
//    become each chunk's first rank within the expert, the experts' first positions and tiles as
//    plan_body makes them. 3. place: position = expert's first + chunk's first + rank. The same
//    groups and tiles as plan_body; positions within an expert follow chunk order, the order
//    inside a chunk is the shared counter's (plan_body's is too: nothing reads it as an order).
__global__ void __launch_bounds__(kPlanChunkThreads) plan_count_kernel(const PlanArgs a) {
  __shared__ int s_cnt[kMaxExperts];
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int E = a.n_experts, n = a.m * a.top_k;
  for (int e = threadIdx.x; e < E; e += kPlanChunkThreads) s_cnt[e] = 0;
  __syncthreads();
  const int p0 = blockIdx.x * kPlanChunk, p1 = min(n, p0 + kPlanChunk);
  for (int p = p0 + threadIdx.x; p < p1; p += kPlanChunkThreads)
    a.pair_pos[p] = pair_rank(a, a.sel, p, s_cnt);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kPlanChunkThreads)
    a.chunk_counts[size_t(blockIdx.x) * E + e] = s_cnt[e];
}

__global__ void __launch_bounds__(kPlanThreads) plan_scan_kernel(const PlanArgs a, int chunks) {
  __shared__ int2 s_warp[kPlanThreads / 32];
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int tid = threadIdx.x, E = a.n_experts;
  int c = 0;
  if (tid < E) {
    int32_t* col = a.chunk_counts + tid;
#pragma unroll 8
    for (int b = 0; b < chunks; ++b) {
      const int v = col[size_t(b) * E];
      col[size_t(b) * E] = c;
      c += v;
    }
  }
  write_groups(a, c, s_warp, nullptr);
}

__global__ void __launch_bounds__(kPlanChunkThreads) plan_place_kernel(const PlanArgs a) {
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int E = a.n_experts, K = a.top_k, n = a.m * K;
  const int p0 = blockIdx.x * kPlanChunk, p1 = min(n, p0 + kPlanChunk);
  const int32_t* first_in_chunk = a.chunk_counts + size_t(blockIdx.x) * E;
  for (int p = p0 + threadIdx.x; p < p1; p += kPlanChunkThreads) {
    const int rank = a.pair_pos[p];
    if (rank < 0) continue;
    const int e = a.sel[p];
    const int pos = a.expert_first[e] + first_in_chunk[e] + rank;
    a.pair_pos[p] = pos;
    a.sorted_row[pos] = p / K;
    a.sorted_wt[pos] = a.wt[p];
  }
}

// Decode: selection of every row (one warp per row, the biased scores of all rows staged by all
// threads first) and the grouping, in one CTA; sel / wt stay in shared memory for the grouping.
// One CTA per SM stated: with the minimum left out, ptxas (13.0) held this kernel to 32
// registers and spilled 12 B (48 without the cap, no spill).
__global__ void __launch_bounds__(kPlanThreads, 1)
    route_plan_small_kernel(const SelectArgs f, const PlanArgs p) {
  extern __shared__ float s_biased[];  // [m][E] biased, then [m][E] raw scores (score routing)
  __shared__ int32_t s_sel[kFusedRouteRows * kMaxTopK];
  __shared__ float s_wt[kFusedRouteRows * kMaxTopK];
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, E = f.n_experts, K = f.top_k;
  const int n = f.m * E;
  float* s_raw = f.tid2eid ? nullptr : s_biased + n;  // the weights' scores: no global re-read
  if (!f.tid2eid) {
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += kPlanThreads) {
      const float sc = f.scores[i];
      s_raw[i] = sc;
      s_biased[i] = f.bias ? __fadd_rn(sc, f.bias[i % E]) : sc;
    }
  }
  __syncthreads();
  for (int r = warp; r < f.m; r += kPlanThreads / 32)
    select_row(f, r, lane, s_biased + size_t(r) * E, s_raw ? s_raw + size_t(r) * E : nullptr,
               s_sel + r * K, s_wt + r * K);
  __syncthreads();
  plan_body(p, s_sel, s_wt);
}

// ---- FP8 fake-quantisation of the first counters[0] rows (cols % 128 == 0) -----------------
// The (row, 128-block) items are contiguous in memory (blocks of a row, then the next row); a
// half-warp quantises one block, 16 bytes a lane. From kQuantRowsDeepItems items a warp loads
// kQuantRowsDeepLoads pairs of blocks before the first is quantised (2 KB a warp in flight; a warp
// per block, 8 bytes a lane, held 256 B: 171 us for the 8K prefill's 201 MB, ~2.4 TB/s); below,
// one pair a warp (decode: four pairs took 2.8 us at one token against 1.6).
constexpr int kQuantRowsDeepLoads = 4;
constexpr long kQuantRowsDeepItems = 32768;
template <int kLoads>
__global__ void __launch_bounds__(256)
    quant_rows_kernel(const __nv_bfloat16* in, __nv_bfloat16* out, int max_rows, int cols,
                      const int32_t* counters) {
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int nb = cols / kActBlock, lane = threadIdx.x % 32, half = lane / 16;
  const long items = long(min(max_rows, counters[0])) * nb;
  const long i0 = (long(blockIdx.x) * 8 + threadIdx.x / 32) * (2 * kLoads);
  if (i0 >= items) return;  // warp-uniform
  uint4 raw[kLoads];
#pragma unroll
  for (int q = 0; q < kLoads; ++q) {
    const long i = i0 + 2 * q + half;
    raw[q] = i < items ? *reinterpret_cast<const uint4*>(in + i * kActBlock + 8 * (lane % 16))
                       : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int q = 0; q < kLoads; ++q) {
    const long i = i0 + 2 * q + half;  // valid: uniform over each half-warp
    quant_block_halfwarp_raw(raw[q], out + i * kActBlock + 8 * (lane % 16), i < items);
  }
}

// ---- combine: one CTA per token row ----------------------------------------------------------
__global__ void __launch_bounds__(256)
    combine_kernel(const int32_t* sel, const int32_t* pair_pos, int top_k, const __nv_bfloat16* ye,
                   const __nv_bfloat16* shared, __nv_bfloat16* y, int dim) {
  __shared__ int s_order[kMaxTopK];
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int r = blockIdx.x;
  if (threadIdx.x < top_k)
    combine_order_slot(sel + size_t(r) * top_k, pair_pos + size_t(r) * top_k, top_k, threadIdx.x,
                       s_order);
  __syncthreads();
  for (int c = threadIdx.x * 8; c < dim; c += blockDim.x * 8) {
    float acc[8];
    combine_sum8(s_order, top_k, ye, size_t(dim), c, acc);
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

namespace {

RouterArgs router_args(const MoeDeviceWeights& w, const MoeArgs& a, const MoeWorkspace& ws) {
  RouterArgs r;
  r.x = a.x;
  r.gate = w.gate.data();
  r.m = a.m;
  r.n_experts = w.n_experts;
  r.dim = w.dim;
  r.sigmoid = a.p.score_func == ScoreFunc::kSigmoid;
  r.logits = ws.logits;
  r.scores = ws.scores;
  r.xq = ws.xq;
  r.counters = ws.counters;
  return r;
}

SelectArgs select_args(const MoeDeviceWeights& w, const MoeArgs& a, const MoeWorkspace& ws) {
  SelectArgs f;
  f.scores = ws.scores;
  f.m = a.m;
  f.n_experts = w.n_experts;
  f.top_k = a.p.top_k;
  f.bias = w.bias.size() ? w.bias.data() : nullptr;
  f.tid2eid = w.hash() ? w.tid2eid.data() : nullptr;
  f.vocab = w.vocab;
  f.tokens = a.tokens;
  f.route_scale = a.p.route_scale;
  f.sel = ws.sel;
  f.wt = ws.wt;
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
  p.chunk_counts = ws.plan_counts;
  return p;
}

// The MMA kernel's tile in m8 x n8 blocks (x: rows / 8, y: experts / 8): enough CTAs at decode
// (Flash at 8 rows: 32 x 4), fewer re-reads and conversions of x beyond 8 rows and of the gate
// beyond 128. At 128 rows the 16-row tile measured slower than 8 rows on the H200
// (moe_router_bench, 72a0033, route stage µs, 8 vs 16 rows: Flash 27.6 vs 29.4, Pro 54.4 vs
// 56.4): the CTAs it loses count for more than the conversions it saves.
int2 router_mma_tile(int m) {
  return m <= 8     ? make_int2(1, 1)
         : m <= 32  ? make_int2(1, 2)
         : m <= 128 ? make_int2(1, 4)
                    : make_int2(2, 4);
}

template <int RT, int TE, int U>
void launch_gemv(const LaunchCtx& c, const RouterArgs& r) {
  const dim3 grid((r.n_experts + TE - 1) / TE, (r.m + RT - 1) / RT);
  launch_kernel(c, router_gemv_kernel<RT, TE, U>, grid, dim3(256), 0, r);
}

}  // namespace

const char* router_path_name(RouterPath p) {
  switch (p) {
    case RouterPath::kAuto:
      return "auto";
    case RouterPath::kGemv:
      return "gemv";
    case RouterPath::kMma:
      return "mma";
    case RouterPath::kTiled:
      return "tiled";
  }
  return "?";
}

RouterPath router_path_choice(int m, RouterPath requested) {
  if (requested != RouterPath::kAuto) {
    DSV4_CHECK(requested != RouterPath::kGemv || m <= kRouterGemvRows, "moe router: the gemv ",
               "kernel takes up to ", kRouterGemvRows, " rows, not ", m);
    return requested;
  }
  if (m <= kRouterAutoGemvRows) return RouterPath::kGemv;
  return m > kRouterAutoMmaRows ? RouterPath::kTiled : RouterPath::kMma;
}

std::string router_kernel_name(int m, RouterPath requested) {
  switch (router_path_choice(m, requested)) {
    case RouterPath::kGemv:
      return m <= 1   ? "router_gemv<1,2>"
             : m <= 2 ? "router_gemv<2,2>"
             : m <= 4 ? "router_gemv<4,2>"
             : m <= 8 ? "router_gemv<8,2>"
                      : "router_gemv<8,4>";
    case RouterPath::kMma:
      return cat("router_mma<", 8 * router_mma_tile(m).x, "x", 8 * router_mma_tile(m).y, ">");
    default:
      return cat("router_tiled<", kRouterTileM, ",", kRouterTileE, ">");
  }
}

void launch_router(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                   const MoeWorkspace& ws) {
  const RouterArgs r = router_args(w, a, ws);
  switch (router_path_choice(a.m, a.router_path)) {
    case RouterPath::kGemv:
      // Loads in flight per thread: U chunks x (RT + TE) 16-byte vectors (~12); experts per
      // CTA: 2 up to 8 rows (128 / 192 CTAs for Flash / Pro at one token), 4 beyond (the x rows
      // are re-read and re-converted once per CTA).
      if (a.m <= 1)
        launch_gemv<1, 2, 4>(c, r);
      else if (a.m <= 2)
        launch_gemv<2, 2, 3>(c, r);
      else if (a.m <= 4)
        launch_gemv<4, 2, 2>(c, r);
      else if (a.m <= 8)
        launch_gemv<8, 2, 1>(c, r);
      else
        launch_gemv<8, 4, 1>(c, r);
      break;
    case RouterPath::kMma: {
      DSV4_CHECK(a.router_mma_rows == 0 || a.router_mma_rows == 8 || a.router_mma_rows == 16,
                 "moe router: the fp64 MMA kernel takes 8 or 16 rows a CTA, not ",
                 a.router_mma_rows);
      int2 t = router_mma_tile(a.m);
      if (a.router_mma_rows == 16) t = make_int2(2, 4);  // the only 16-row variant
      if (a.router_mma_rows == 8) t.x = 1;
      const dim3 grid((w.n_experts + 8 * t.y - 1) / (8 * t.y), (a.m + 8 * t.x - 1) / (8 * t.x),
                      kRouterCluster);
      if (t.y == 1)
        launch_kernel(c, router_mma_kernel<1, 1>, grid, dim3(256), 0, r);
      else if (t.y == 2)
        launch_kernel(c, router_mma_kernel<1, 2>, grid, dim3(256), 0, r);
      else if (t.x == 1)
        launch_kernel(c, router_mma_kernel<1, 4>, grid, dim3(256), 0, r);
      else
        launch_kernel(c, router_mma_kernel<2, 4>, grid, dim3(256), 0, r);
      break;
    }
    default: {
      constexpr int TM = kRouterTileM, TE = kRouterTileE;
      const dim3 grid((w.n_experts + TE - 1) / TE, (a.m + TM - 1) / TM);
      launch_kernel(c, router_tiled_kernel<TM, TE>, grid, dim3(256), 0, r);
    }
  }
}

bool route_plan_fused(int m, int n_experts) {
  return m <= kFusedRouteRows && size_t(m) * n_experts * sizeof(float) <= kFusedRouteSmem;
}

void launch_route_select(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                         const MoeWorkspace& ws) {
  const size_t smem = size_t(kFinishWarps) * w.n_experts * sizeof(float);
  launch_kernel(c, route_select_kernel, dim3((a.m + kFinishWarps - 1) / kFinishWarps),
                dim3(32 * kFinishWarps), smem, select_args(w, a, ws));
}

void launch_plan(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                 const MoeWorkspace& ws, int tile_n) {
  const PlanArgs p = plan_args(w, a, ws, tile_n);
  const long pairs = long(a.m) * a.p.top_k;
  if (pairs < kPlanMultiMinPairs) {
    launch_kernel(c, plan_kernel, dim3(1), dim3(kPlanThreads), 0, p);
    return;
  }
  const int chunks = int(plan_chunks(pairs));
  launch_kernel(c, plan_count_kernel, dim3(chunks), dim3(kPlanChunkThreads), 0, p);
  launch_kernel(c, plan_scan_kernel, dim3(1), dim3(kPlanThreads), 0, p, chunks);
  launch_kernel(c, plan_place_kernel, dim3(chunks), dim3(kPlanChunkThreads), 0, p);
}

void launch_route_plan_small(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                             const MoeWorkspace& ws, int tile_n) {
  static std::atomic<uint64_t> attr{0};
  once_per_device(attr, [] {
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(route_plan_small_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(2 * kFusedRouteSmem)));
  });
  // Score routing stages the biased and the raw scores; hash routing neither.
  const size_t smem = w.hash() ? 0 : 2 * size_t(a.m) * w.n_experts * sizeof(float);
  launch_kernel(c, route_plan_small_kernel, dim3(1), dim3(kPlanThreads), smem,
                select_args(w, a, ws), plan_args(w, a, ws, tile_n));
}

void launch_quant_rows(const LaunchCtx& c, const __nv_bfloat16* in, __nv_bfloat16* out,
                       int max_rows, int cols, const int32_t* counters) {
  if (max_rows == 0) return;
  DSV4_CHECK(cols % kActBlock == 0, "moe: activation quantisation of ", cols,
             " columns (a multiple of ", kActBlock, " required)");
  const long items = long(max_rows) * (cols / kActBlock);
  const bool deep = items >= kQuantRowsDeepItems;
  const long per_cta = 8 * 2 * (deep ? kQuantRowsDeepLoads : 1);
  launch_kernel(c, deep ? quant_rows_kernel<kQuantRowsDeepLoads> : quant_rows_kernel<1>,
                dim3(unsigned((items + per_cta - 1) / per_cta)), dim3(256), 0, in, out, max_rows,
                cols, counters);
}

void launch_combine(const LaunchCtx& c, const MoeWorkspace& ws, int m, int top_k,
                    const __nv_bfloat16* shared, __nv_bfloat16* y, int dim) {
  launch_kernel(c, combine_kernel, dim3(m), dim3(256), 0, static_cast<const int32_t*>(ws.sel),
                static_cast<const int32_t*>(ws.pair_pos), top_k,
                static_cast<const __nv_bfloat16*>(ws.ye), shared, y, dim);
}

}  // namespace dsv4::cuda::moe
