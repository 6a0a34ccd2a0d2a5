// Per-token mHC kernel (mhc_token.h): one CTA per token for the widths the cluster kernels do not
// take. Phases, all within the CTA:
//   A. every thread takes chunks c = tid, tid + T, ... of 8 values of the token's flattened
//      streams X [4*dim]: sum of squares and the projection X fn^T, in fp64 (exact products);
//   B. fixed-order reduction: butterflies within each warp (every lane ends with the same value:
//      IEEE addition commutes), then warp 0 adds the warps' partials in index order; warp 0 then
//      computes the RMS factor, the mixes and the gates (pre to shared memory, post to memory,
//      the raw comb to shared memory);
//   C. the last warp runs Sinkhorn on 16 lanes and writes comb, while every thread collapses its
//      chunks of y = bf16(sum_j pre_j h_j) (and, with the fused RMSNorm, a second reduction of
//      y's sum of squares, then y is recomputed and scaled).
// The fn rows are read once per token (from L2: a CTA per token shares nothing); fine for the
// small widths this path exists for (dim 128: 48 KB per token), a few MB per token at widths of
// several thousands that only hypothetical checkpoints have.
#include "ops/cuda/mhc/mhc_token.h"

#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/mhc/mhc_config.h"
#include "ops/cuda/mhc/mhc_math.cuh"

namespace dsv4::cuda::mhc_token {
namespace {

using namespace mhc_cfg;
using namespace mhc_math;

constexpr int kMaxWarps = kTokenMaxThreads / 32;

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <bool kHead>
__global__ void __launch_bounds__(kTokenMaxThreads) hc_token_kernel(const Params p) {
  constexpr int kMix = kHead ? kMixHead : kMixPre;
  __shared__ double red[kMaxWarps][kMix + 1];  // per-warp partials: mixes, then sum of squares
  __shared__ float raw_comb[16];               // comb before Sinkhorn
  __shared__ float pre[kHc];
  __shared__ double red_y[kMaxWarps];  // fused norm: per-warp sums of squares of y

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int64_t t = blockIdx.x;
  const int64_t hd = int64_t(kHc) * p.dim;
  const __nv_bfloat16* X = p.streams + t * hd;

  // ---- A: sum of squares and projection over this thread's chunks ----
  double acc[kMix + 1];  // acc[kMix]: sum of squares
#pragma unroll
  for (int r = 0; r <= kMix; ++r) acc[r] = 0.0;
  const int chunks = int(hd / 8);
  for (int c = tid; c < chunks; c += blockDim.x) {
    float x[8];
    unpack8(__ldg(reinterpret_cast<const uint4*>(X) + c), x);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[kMix] += double(fmul(x[e], x[e]));  // BF16^2: exact in fp32
#pragma unroll
    for (int r = 0; r < kMix; ++r) {
      const float4* f = reinterpret_cast<const float4*>(p.fn + r * hd) + 2 * c;
      const float4 f0 = __ldg(f), f1 = __ldg(f + 1);
      const float fv[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r] += double(x[e]) * double(fv[e]);  // exact product
    }
  }

  // ---- B: reduction, RMS factor, gates ----
#pragma unroll
  for (int r = 0; r <= kMix; ++r) {
    const double v = warp_sum(acc[r]);
    if (lane == 0) red[warp][r] = v;
  }
  __syncthreads();
  if (warp == 0) {
    // Lane v owns value v (kMix + 1 <= 32 values); the sum of squares is shuffled to all lanes.
    double s = 0.0;
    if (lane <= kMix)
      for (int w = 0; w < nwarps; ++w) s += red[w][lane];
    const double ss = __shfl_sync(0xffffffffu, s, kMix);
    const float ms = float(ss / double(hd));
    const float rs = __fdiv_rn(1.0f, __fsqrt_rn(fadd(ms, p.norm_eps)));
    const int v = lane;
    const float m = fmul(float(s), rs);
    if (v < kHc)
      pre[v] = fadd(sigmoidf_ref(fadd(fmul(m, __ldg(p.scale)), __ldg(p.base + v))), p.hc_eps);
    if constexpr (!kHead) {
      if (v >= kHc && v < 2 * kHc)
        p.post[t * kHc + (v - kHc)] =
            fmul(2.0f, sigmoidf_ref(fadd(fmul(m, __ldg(p.scale + 1)), __ldg(p.base + v))));
      else if (v >= 2 * kHc && v < kMix)
        raw_comb[v - 2 * kHc] = fadd(fmul(m, __ldg(p.scale + 2)), __ldg(p.base + v));
    }
  }
  __syncthreads();

  // ---- C: Sinkhorn (last warp), collapse (all) ----
  if constexpr (!kHead) {
    if (warp == nwarps - 1) {
      // Both half-warps normalise the same matrix (sinkhorn4_lanes needs the full warp).
      const float c = sinkhorn4_lanes(raw_comb[lane & 15], p.iters, p.hc_eps);
      if (lane < 16) p.comb[t * 16 + lane] = c;
    }
  }
  const float w0 = pre[0], w1 = pre[1], w2 = pre[2], w3 = pre[3];
  const int dchunks = p.dim / 8;
  auto collapse = [&](int c, float(&yv)[8]) {
    float xv[kHc][8];
#pragma unroll
    for (int j = 0; j < kHc; ++j)
      unpack8(__ldg(reinterpret_cast<const uint4*>(X + int64_t(j) * p.dim) + c), xv[j]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float s = fmul(w0, xv[0][e]);
      s = fadd(s, fmul(w1, xv[1][e]));
      s = fadd(s, fmul(w2, xv[2][e]));
      s = fadd(s, fmul(w3, xv[3][e]));
      yv[e] = __bfloat162float(__float2bfloat16_rn(s));
    }
  };
  uint4* Y = reinterpret_cast<uint4*>(p.y + t * p.dim);
  if (p.norm_w == nullptr) {
    for (int c = tid; c < dchunks; c += blockDim.x) {
      float yv[8];
      collapse(c, yv);
      Y[c] = pack8(yv);
    }
    return;
  }
  double ssy = 0.0;
  for (int c = tid; c < dchunks; c += blockDim.x) {
    float yv[8];
    collapse(c, yv);
#pragma unroll
    for (int e = 0; e < 8; ++e) ssy += double(fmul(yv[e], yv[e]));
  }
  ssy = warp_sum(ssy);
  if (lane == 0) red_y[warp] = ssy;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < nwarps; ++w) s += red_y[w];
  const float ms = float(s / double(p.dim));
  const float rs = __fdiv_rn(1.0f, __fsqrt_rn(fadd(ms, p.nrm_eps)));
  for (int c = tid; c < dchunks; c += blockDim.x) {
    float yv[8], wv[8];
    collapse(c, yv);
    unpack8(__ldg(reinterpret_cast<const uint4*>(p.norm_w) + c), wv);
#pragma unroll
    for (int e = 0; e < 8; ++e) yv[e] = fmul(wv[e], fmul(yv[e], rs));
    Y[c] = pack8(yv);
  }
}

}  // namespace

void launch(const Params& p, cudaStream_t stream) {
  if (p.tokens == 0) return;
  const int threads = token_threads(p.dim);
  if (p.head)
    hc_token_kernel<true><<<p.tokens, threads, 0, stream>>>(p);
  else
    hc_token_kernel<false><<<p.tokens, threads, 0, stream>>>(p);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsv4::cuda::mhc_token
