// BF16 weight-streaming linear for decode batch sizes (bf16_stream_linear.h). One warp per
// kRowsPerWarp output rows of the stacked weights, kWarps warps per CTA: every lane loads
// 16-byte chunks of each of its rows (kUnroll chunks a row in flight) and the matching chunks of
// the x rows (L1-resident: every warp of the CTA reads the same x), fp32 FMAs, then a butterfly.
#include "ops/cuda/gemm/bf16_stream_linear.h"

#include <cstdint>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/numerics.cuh"
#include "ops/cuda/common/sm90/gmem.cuh"
#include "ops/cuda/common/sm90/sync.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 2;
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int kUnroll = 8;  // chunks of each row in flight per lane

struct Args {
  const __nv_bfloat16* x;
  int64_t ldx;
  int m, k;
  const __nv_bfloat16* w0;
  const __nv_bfloat16* w1;
  int n0, rows;  // rows of weight 0; of all weights
  void* y0;
  void* y1;
  int64_t ldy0, ldy1;
  bool f32_0, f32_1;
};

__device__ __forceinline__ const __nv_bfloat16* weight_row(const Args& a, int row) {
  return row < a.n0 ? a.w0 + int64_t(row) * a.k : a.w1 + int64_t(row - a.n0) * a.k;
}

// MT: rows of x the kernel is compiled for (>= a.m; rows past a.m are neither read nor written).
template <int MT>
__global__ void __launch_bounds__(kWarps * 32) bf16_stream_linear_kernel(const Args a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // The CTA's weight rows into L2 while the kernel before finishes (weights: nothing in the
  // stream writes them).
  if (threadIdx.x < kRowsPerCta) {
    const int row = blockIdx.x * kRowsPerCta + threadIdx.x;
    if (row < a.rows) sm90::prefetch_l2_bulk(weight_row(a, row), uint32_t(a.k) * 2);
  }
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();

  const int row0 = blockIdx.x * kRowsPerCta + warp * kRowsPerWarp;
  if (row0 >= a.rows) return;  // warp-uniform
  const uint4* wr[kRowsPerWarp];
  bool valid[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    valid[r] = row0 + r < a.rows;
    wr[r] = reinterpret_cast<const uint4*>(weight_row(a, valid[r] ? row0 + r : row0));
  }
  const int nchunk = a.k / 8;
  const int64_t xstride = a.ldx / 8;
  const uint4* xr = reinterpret_cast<const uint4*>(a.x);
  float acc[kRowsPerWarp][MT];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < MT; ++i) acc[r][i] = 0.0f;

  for (int c0 = 0; c0 < nchunk; c0 += 32 * kUnroll) {
    uint4 wv[kUnroll][kRowsPerWarp];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u + lane;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        wv[u][r] = c < nchunk && valid[r] ? __ldg(wr[r] + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u + lane;
      if (c >= nchunk) break;  // the chunks past the end carry nothing (lane-local)
      float wf[kRowsPerWarp][8];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) num::unpack8(wv[u][r], wf[r]);
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        if (i >= a.m) break;
        float xf[8];
        num::unpack8(__ldg(xr + i * xstride + c), xf);
#pragma unroll
        for (int e = 0; e < 8; ++e)
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) acc[r][i] = fmaf(wf[r][e], xf[e], acc[r][i]);
      }
    }
  }
  // Butterfly: every lane ends with every sum (the same bits: a + b = b + a).
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][i] += __shfl_xor_sync(0xffffffffu, acc[r][i], o);
        // Lane r * MT + i stores (x row i, weight row row0 + r).
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      if (lane != r * MT + i || i >= a.m || !valid[r]) continue;
      const int row = row0 + r;
      const bool first = row < a.n0;
      const int col = first ? row : row - a.n0;
      void* y = first ? a.y0 : a.y1;
      const int64_t off = int64_t(i) * (first ? a.ldy0 : a.ldy1) + col;
      if (first ? a.f32_0 : a.f32_1)
        static_cast<float*>(y)[off] = acc[r][i];
      else
        static_cast<__nv_bfloat16*>(y)[off] = __float2bfloat16_rn(acc[r][i]);
    }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

void bf16_stream_linear(const Bf16StreamLinearParams& p, cudaStream_t stream) {
  DSV4_CHECK(p.m >= 0 && p.m <= kBf16StreamMaxM, "bf16_stream_linear: m = ", p.m, " (it takes 0..",
             kBf16StreamMaxM, " rows)");
  DSV4_CHECK(p.k > 0 && p.k % 8 == 0, "bf16_stream_linear: k = ", p.k,
             " must be a positive multiple of 8");
  const int64_t ldx = p.ldx ? p.ldx : p.k;
  DSV4_CHECK(ldx >= p.k && ldx % 8 == 0, "bf16_stream_linear: row stride ", ldx,
             " must be >= k and a multiple of 8");
  DSV4_CHECK(p.count >= 1 && p.count <= kBf16StreamMaxOuts, "bf16_stream_linear: ", p.count,
             " weights (1..", kBf16StreamMaxOuts, ")");
  int64_t rows = 0;
  for (int i = 0; i < p.count; ++i) {
    const Bf16StreamOut& o = p.out[i];
    DSV4_CHECK(o.w != nullptr && o.y != nullptr && aligned16(o.w), "bf16_stream_linear: weight ", i,
               " needs a 16-byte aligned weight and an output");
    DSV4_CHECK(o.n > 0 && o.ldy >= o.n, "bf16_stream_linear: weight ", i, " has n = ", o.n,
               ", ldy = ", o.ldy);
    rows += o.n;
  }
  DSV4_CHECK(rows < (int64_t(1) << 30), "bf16_stream_linear: ", rows, " output rows");
  if (p.m == 0) return;
  DSV4_CHECK(p.x != nullptr && aligned16(p.x), "bf16_stream_linear: x must be 16-byte aligned");
  Args a;
  a.x = p.x;
  a.ldx = ldx;
  a.m = p.m;
  a.k = p.k;
  a.w0 = p.out[0].w;
  a.n0 = p.out[0].n;
  a.y0 = p.out[0].y;
  a.ldy0 = p.out[0].ldy;
  a.f32_0 = p.out[0].f32;
  const bool two = p.count == 2;
  a.w1 = two ? p.out[1].w : nullptr;
  a.y1 = two ? p.out[1].y : nullptr;
  a.ldy1 = two ? p.out[1].ldy : 0;
  a.f32_1 = two && p.out[1].f32;
  a.rows = int(rows);
  LaunchConfig c;
  c.grid = dim3(unsigned((rows + kRowsPerCta - 1) / kRowsPerCta));
  c.block = dim3(kWarps * 32);
  c.stream = stream;
  c.pdl = p.pdl;
  if (p.m <= 1)
    launch_kernel(c, bf16_stream_linear_kernel<1>, a);
  else if (p.m <= 2)
    launch_kernel(c, bf16_stream_linear_kernel<2>, a);
  else if (p.m <= 4)
    launch_kernel(c, bf16_stream_linear_kernel<4>, a);
  else
    launch_kernel(c, bf16_stream_linear_kernel<8>, a);
}

}  // namespace dsv4::cuda
