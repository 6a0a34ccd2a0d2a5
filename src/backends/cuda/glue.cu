#include "backends/cuda/glue.h"

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/gemm/act_quant.cuh"

namespace dsv4::glue {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  return unsigned((n + kThreads - 1) / kThreads);
}

// cpu::expert_forward: g / (1 + exp(-g)) * u, each operation rounded once.
__device__ __forceinline__ float swiglu_value(float g, float u, float limit) {
  if (limit > 0) {
    u = fminf(fmaxf(u, -limit), limit);
    g = fminf(g, limit);
  }
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

__global__ void swiglu_kernel(const __nv_bfloat16* __restrict__ gu, int64_t ld, int rows, int inter,
                              float limit, __nv_bfloat16* __restrict__ out) {
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= int64_t(rows) * inter) return;
  const int64_t r = idx / inter;
  const int i = int(idx % inter);
  const float g = __bfloat162float(gu[r * ld + i]);
  const float u = __bfloat162float(gu[r * ld + inter + i]);
  out[idx] = __float2bfloat16_rn(swiglu_value(g, u, limit));
}

// The same values, a half-warp per 128-element block (8 per lane), quantised for the FP8 GEMM
// that reads them next (cuda::act_quant). Launched programmatically: gu is read after
// griddepcontrol.wait, and the GEMM may launch at once (it waits for this grid in turn).
__global__ void __launch_bounds__(kThreads)
    swiglu_fp8_kernel(const __nv_bfloat16* __restrict__ gu, int64_t ld, int rows, int inter,
                      float limit, __nv_bfloat16* __restrict__ out, uint8_t* __restrict__ codes,
                      float* __restrict__ scales_t, int ld_scales) {
  cuda::sm90::griddep_wait();
  cuda::sm90::griddep_launch_dependents();
  const int kb_per_row = inter / 128;
  const int64_t blocks = int64_t(rows) * kb_per_row;
  const int hl = threadIdx.x & 15;
  // Uniform over the warp: both half-warps run the shuffles, an idle one with zeros.
  const int64_t blk0 = (int64_t(blockIdx.x) * kThreads + (threadIdx.x & ~31)) / 16;
  if (blk0 >= blocks) return;
  const int64_t blk = blk0 + ((threadIdx.x & 31) >> 4);
  const bool valid = blk < blocks;
  const int64_t r = valid ? blk / kb_per_row : 0;
  const int kb = valid ? int(blk % kb_per_row) : 0;
  const int64_t col = int64_t(kb) * 128 + hl * 8;
  float v[8];
  if (valid) {
    const uint4 graw = __ldg(reinterpret_cast<const uint4*>(gu + r * ld + col));
    const uint4 uraw = __ldg(reinterpret_cast<const uint4*>(gu + r * ld + inter + col));
    const __nv_bfloat16* gb = reinterpret_cast<const __nv_bfloat16*>(&graw);
    const __nv_bfloat16* ub = reinterpret_cast<const __nv_bfloat16*>(&uraw);
    uint4 o;
    __nv_bfloat16* ob = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      ob[e] = __float2bfloat16_rn(
          swiglu_value(__bfloat162float(gb[e]), __bfloat162float(ub[e]), limit));
      v[e] = __bfloat162float(ob[e]);
    }
    *reinterpret_cast<uint4*>(out + r * inter + col) = o;
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.0f;
  }
  uint32_t ex = 0;
  const uint2 c = cuda::act_quant::quantize_block8(v, ex);
  if (!valid) return;
  *reinterpret_cast<uint2*>(codes + r * inter + col) = c;
  if (hl == 0) cuda::act_quant::store_block_scale(scales_t, ld_scales, kb, r, rows, ex);
}

__global__ void mtp_combine_kernel(const __nv_bfloat16* __restrict__ e,
                                   const __nv_bfloat16* __restrict__ h, int tokens, int hc, int dim,
                                   __nv_bfloat16* __restrict__ x) {
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= int64_t(tokens) * hc * dim) return;
  const int d = int(idx % dim);
  const int64_t t = idx / (int64_t(hc) * dim);
  x[idx] =
      __float2bfloat16_rn(__fadd_rn(__bfloat162float(e[t * dim + d]), __bfloat162float(h[idx])));
}

__global__ void gather_rows_kernel(const uint4* __restrict__ src, int64_t row_vecs,
                                   const int32_t* __restrict__ rows, int n,
                                   uint4* __restrict__ dst) {
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= int64_t(n) * row_vecs) return;
  const int64_t i = idx / row_vecs, v = idx % row_vecs;
  dst[idx] = src[int64_t(rows[i]) * row_vecs + v];
}

__global__ void move_rows_kernel(const uint4* __restrict__ a, const uint4* __restrict__ b,
                                 int64_t row_vecs, const int32_t* __restrict__ src,
                                 const int32_t* __restrict__ dst_rows, int n,
                                 uint4* __restrict__ dst) {
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= int64_t(n) * row_vecs) return;
  const int64_t i = idx / row_vecs, v = idx % row_vecs;
  const int32_t s = src[i];
  const uint4 x = s >= 0 ? a[int64_t(s) * row_vecs + v] : b[int64_t(-s - 1) * row_vecs + v];
  dst[int64_t(dst_rows ? dst_rows[i] : int32_t(i)) * row_vecs + v] = x;
}

template <typename T>
__device__ void copy_as(const uint8_t* src, uint8_t* dst, int64_t bytes) {
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  for (int64_t i = threadIdx.x; i < bytes / int64_t(sizeof(T)); i += blockDim.x) d[i] = s[i];
}

__global__ void copy_segments_kernel(const CopySegment* __restrict__ segs) {
  const CopySegment g = segs[blockIdx.x];
  const uintptr_t align = uintptr_t(g.src) | uintptr_t(g.dst) | uintptr_t(g.bytes);
  if (align % 16 == 0)
    copy_as<uint4>(g.src, g.dst, g.bytes);
  else if (align % 8 == 0)
    copy_as<uint2>(g.src, g.dst, g.bytes);
  else if (align % 4 == 0)
    copy_as<uint32_t>(g.src, g.dst, g.bytes);
  else
    copy_as<uint8_t>(g.src, g.dst, g.bytes);
}

}  // namespace

void move_rows(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t row_elems,
               const int32_t* src, const int32_t* dst_rows, int n, __nv_bfloat16* dst,
               cudaStream_t stream) {
  DSV4_CHECK(row_elems % 8 == 0, "move_rows: row of ", row_elems, " elements");
  if (n == 0) return;
  const int64_t vecs = row_elems / 8;
  move_rows_kernel<<<blocks_for(n * vecs), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(a), reinterpret_cast<const uint4*>(b), vecs, src, dst_rows, n,
      reinterpret_cast<uint4*>(dst));
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void copy_segments(const CopySegment* segments, int n, cudaStream_t stream) {
  if (n == 0) return;
  copy_segments_kernel<<<unsigned(n), kThreads, 0, stream>>>(segments);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void swiglu(const __nv_bfloat16* gu, int64_t ld_gu, int rows, int inter, float limit,
            __nv_bfloat16* out, cudaStream_t stream) {
  DSV4_CHECK(rows >= 0 && inter > 0 && ld_gu >= 2 * inter, "swiglu: bad shape");
  if (rows == 0) return;
  swiglu_kernel<<<blocks_for(int64_t(rows) * inter), kThreads, 0, stream>>>(gu, ld_gu, rows, inter,
                                                                            limit, out);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void swiglu_fp8(const SwigluFp8Params& p, cudaStream_t stream) {
  DSV4_CHECK(p.rows >= 0 && p.inter > 0 && p.inter % 128 == 0 && p.ld_gu >= 2 * p.inter &&
                 p.ld_gu % 8 == 0,
             "swiglu_fp8: rows=", p.rows, " inter=", p.inter, " (multiple of 128) ld_gu=", p.ld_gu);
  DSV4_CHECK(p.ld_scales >= (p.rows + 3) / 4 * 4 && p.ld_scales % 4 == 0, "swiglu_fp8: ld_scales ",
             p.ld_scales, " for ", p.rows, " rows");
  if (p.rows == 0) return;
  const auto a16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  DSV4_CHECK(p.gu && p.out && p.codes && p.scales_t && a16(p.gu) && a16(p.out) && a16(p.codes),
             "swiglu_fp8: null or unaligned pointer");
  const int64_t halves = int64_t(p.rows) * (p.inter / 128);
  cuda::LaunchConfig cfg;
  cfg.grid = dim3(unsigned((halves * 16 + kThreads - 1) / kThreads), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = p.pdl;
  cuda::launch_kernel(cfg, swiglu_fp8_kernel, p.gu, p.ld_gu, p.rows, p.inter, p.limit, p.out,
                      p.codes, p.scales_t, p.ld_scales);
}

void mtp_combine(const __nv_bfloat16* e, const __nv_bfloat16* h, int tokens, int hc, int dim,
                 __nv_bfloat16* x, cudaStream_t stream) {
  if (tokens == 0) return;
  mtp_combine_kernel<<<blocks_for(int64_t(tokens) * hc * dim), kThreads, 0, stream>>>(e, h, tokens,
                                                                                      hc, dim, x);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void gather_rows(const __nv_bfloat16* src, int64_t row_elems, const int32_t* rows, int n,
                 __nv_bfloat16* dst, cudaStream_t stream) {
  DSV4_CHECK(row_elems % 8 == 0, "gather_rows: row of ", row_elems, " elements");
  if (n == 0) return;
  const int64_t vecs = row_elems / 8;
  gather_rows_kernel<<<blocks_for(n * vecs), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(src), vecs, rows, n, reinterpret_cast<uint4*>(dst));
  DSV4_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsv4::glue
