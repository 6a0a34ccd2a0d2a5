#include "ops/cuda/norm/norm.h"

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/gemm/act_quant.cuh"
#include "ops/cuda/norm/norm_config.h"

namespace dsv4::cuda {
namespace {

using namespace norm_cfg;

// kEarly (decode-sized steps): the weight is loaded before the wait, into registers (2x of them:
// one CTA an SM, which the many CTAs of prefill-sized steps would feel).
template <int kGroup, bool kEarly>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(RmsNormParams p) {
  constexpr int kRowsPerCta = kThreads / kGroup;
  constexpr int kWarps = kGroup / 32;
  __shared__ double red[kThreads / 32];
  const int gi = threadIdx.x / kGroup, gl = threadIdx.x % kGroup;
  const int lane = threadIdx.x % 32;
  const int chunks = p.n / 8;
  // The weight is no kernel's output: loaded before the wait. Once this kernel lets the next
  // one launch, a weight-streaming GEMM fills HBM's queues with its prefetch, and a weight
  // loaded after that waited behind it (H200: ~9 us of the q_norm between wq_a and wq_b).
  [[maybe_unused]] uint4 wr[kEarly ? kMaxChunks : 1];
  if constexpr (kEarly) {
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      const int ch = gl + c * kGroup;
      wr[c] = ch < chunks ? __ldg(reinterpret_cast<const uint4*>(p.weight + ch * 8))
                          : make_uint4(0, 0, 0, 0);
    }
  }
  // Launched programmatically (p.pdl): x is read only once the kernel before is complete; the
  // next kernel may launch at once (it waits for this grid's completion in turn).
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int64_t ldx = p.ldx ? p.ldx : p.n, ldy = p.ldy ? p.ldy : p.n;
  for (int64_t row0 = int64_t(blockIdx.x) * kRowsPerCta; row0 < p.rows;
       row0 += int64_t(gridDim.x) * kRowsPerCta) {
    const int64_t row = row0 + gi;
    const bool valid = row < p.rows;
    uint4 v[kMaxChunks];
    double ss = 0.0;
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      const int ch = gl + c * kGroup;
      v[c] = make_uint4(0, 0, 0, 0);
      if (valid && ch < chunks)
        v[c] = __ldg(reinterpret_cast<const uint4*>(p.x + row * ldx + ch * 8));
      const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&v[c]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float f = __bfloat162float(b[e]);
        ss += double(f * f);  // exact: a BF16 square fits in fp32
      }
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if constexpr (kWarps > 1) {
      if (lane == 0) red[threadIdx.x / 32] = ss;
      __syncthreads();
      ss = 0.0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) ss += red[gi * kWarps + w];
      __syncthreads();
    }
    const float ms = float(ss / double(p.n));
    const float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, p.eps)));
    // valid is uniform over the row's group (a whole number of warps): the quantisation's
    // half-warp shuffles run with every lane of the warp.
    if (valid) {
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        if (c * kGroup >= chunks) break;  // uniform over the group
        const int ch = gl + c * kGroup;
        const bool in = ch < chunks;  // uniform over each half-warp when n % 128 == 0
        float yv[8];
        if (in) {
          uint4 wv;
          if constexpr (kEarly)
            wv = wr[c];
          else
            wv = __ldg(reinterpret_cast<const uint4*>(p.weight + ch * 8));
          const __nv_bfloat16* xb = reinterpret_cast<const __nv_bfloat16*>(&v[c]);
          const __nv_bfloat16* wb = reinterpret_cast<const __nv_bfloat16*>(&wv);
          uint4 out;
          __nv_bfloat16* ob = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            ob[e] = __float2bfloat16_rn(
                __fmul_rn(__bfloat162float(wb[e]), __fmul_rn(__bfloat162float(xb[e]), rs)));
            yv[e] = __bfloat162float(ob[e]);
          }
          *reinterpret_cast<uint4*>(p.y + row * ldy + ch * 8) = out;
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) yv[e] = 0.0f;
        }
        if (p.q_codes) {  // uniform over the grid
          // A half-warp holds one 128-element block: chunks 16j..16j+15 sit on lanes with the
          // same gl / 16 (kGroup is a multiple of 32).
          uint32_t ex = 0;
          const uint2 codes = act_quant::quantize_block8(yv, ex);
          if (in) {
            *reinterpret_cast<uint2*>(p.q_codes + row * p.n + ch * 8) = codes;
            if ((ch & 15) == 0)
              act_quant::store_block_scale(p.q_scales_t, p.q_ld_scales, ch / 16, row, p.rows, ex);
          }
        }
      }
    }
  }
}

template <int kGroup>
void launch(const RmsNormParams& p, cudaStream_t stream) {
  constexpr int kRowsPerCta = kThreads / kGroup;
  const int64_t ctas = (int64_t(p.rows) + kRowsPerCta - 1) / kRowsPerCta;
  const int grid = int(std::min<int64_t>(ctas, 1 << 16));
  LaunchConfig cfg;
  cfg.grid = dim3(unsigned(grid), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = p.pdl;
  if (p.rows <= kEarlyMaxRows)
    launch_kernel(cfg, rms_norm_kernel<kGroup, true>, p);
  else
    launch_kernel(cfg, rms_norm_kernel<kGroup, false>, p);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

void rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  DSV4_CHECK(p.n > 0 && p.n % 8 == 0 && p.n <= kMaxWidth, "rms_norm: width ", p.n,
             " must be a positive multiple of 8, at most ", kMaxWidth);
  DSV4_CHECK(p.rows >= 0, "rms_norm: rows = ", p.rows);
  if (p.rows == 0) return;
  const int64_t ldx = p.ldx ? p.ldx : p.n, ldy = p.ldy ? p.ldy : p.n;
  DSV4_CHECK(ldx >= p.n && ldy >= p.n && ldx % 8 == 0 && ldy % 8 == 0, "rms_norm: row strides ",
             ldx, "/", ldy, " must be >= n and multiples of 8");
  DSV4_CHECK(p.x && p.weight && p.y, "rms_norm: null pointer");
  DSV4_CHECK(aligned16(p.x) && aligned16(p.weight) && aligned16(p.y),
             "rms_norm: pointers must be 16-byte aligned");
  if (p.q_codes) {
    DSV4_CHECK(p.n % 128 == 0,
               "rms_norm: the fused FP8 quantisation needs n % 128 == 0, n = ", p.n);
    DSV4_CHECK(p.q_scales_t && aligned16(p.q_codes),
               "rms_norm: quantisation codes must be 16-byte aligned, with scales");
    DSV4_CHECK(p.q_ld_scales >= (p.rows + 3) / 4 * 4 && p.q_ld_scales % 4 == 0,
               "rms_norm: q_ld_scales ", p.q_ld_scales, " must be a multiple of 4 >= rows (",
               p.rows, ") rounded up to 4");
  }
  switch (group_for(p.n)) {
    case 32:
      return launch<32>(p, stream);
    case 128:
      return launch<128>(p, stream);
    default:
      return launch<256>(p, stream);
  }
}

}  // namespace dsv4::cuda
