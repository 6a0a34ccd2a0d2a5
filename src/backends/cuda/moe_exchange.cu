#include "backends/cuda/moe_exchange.h"

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/moe/combine_order.cuh"

namespace dsv4::exchange {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxTopK = 32;

struct Layout {
  size_t sel, wt, xq, total;
};

__host__ __device__ inline Layout layout(int cap, int top_k, int dim) {
  Layout l;
  const size_t pairs = size_t(cap) * size_t(top_k);
  l.sel = 16;
  l.wt = l.sel + (pairs * 4 + 15) / 16 * 16;
  l.xq = l.wt + (pairs * 4 + 15) / 16 * 16;
  l.total = (l.xq + size_t(cap) * size_t(dim) * 2 + 255) / 256 * 256;
  return l;
}

__device__ __forceinline__ void copy_row(const __nv_bfloat16* src, __nv_bfloat16* dst, int dim) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  for (int v = threadIdx.x; v < dim / 8; v += blockDim.x) d[v] = s[v];
}

__global__ void pack_kernel(const int32_t* __restrict__ sel, const float* __restrict__ wt,
                            const __nv_bfloat16* __restrict__ xq, int m, int top_k, int dim,
                            int cap, uint8_t* __restrict__ slab) {
  const Layout l = layout(cap, top_k, dim);
  const int r = blockIdx.x;
  if (r == 0 && threadIdx.x == 0) *reinterpret_cast<int32_t*>(slab) = m;
  if (r >= m) return;
  int32_t* s = reinterpret_cast<int32_t*>(slab + l.sel);
  float* w = reinterpret_cast<float*>(slab + l.wt);
  for (int k = threadIdx.x; k < top_k; k += blockDim.x) {
    s[size_t(r) * top_k + k] = sel[size_t(r) * top_k + k];
    w[size_t(r) * top_k + k] = wt[size_t(r) * top_k + k];
  }
  copy_row(xq + size_t(r) * dim, reinterpret_cast<__nv_bfloat16*>(slab + l.xq) + size_t(r) * dim,
           dim);
}

__global__ void select_kernel(const uint8_t* __restrict__ slabs, int cap, int top_k, int dim,
                              int lo, int count, int out_k, int32_t* __restrict__ sel,
                              float* __restrict__ wt, __nv_bfloat16* __restrict__ xq) {
  const Layout l = layout(cap, top_k, dim);
  const int r = blockIdx.x, s = r / cap, i = r % cap;
  const uint8_t* slab = slabs + size_t(s) * l.total;
  const bool valid = i < *reinterpret_cast<const int32_t*>(slab);
  if (threadIdx.x == 0) {
    // The row's slots of the owner's experts, first occurrences in slot order (a hash row's
    // repeated expert counts once, with its first slot's weight, as the grouping does).
    const int32_t* ss = reinterpret_cast<const int32_t*>(slab + l.sel) + size_t(i) * top_k;
    const float* sw = reinterpret_cast<const float*>(slab + l.wt) + size_t(i) * top_k;
    int32_t* so = sel + size_t(r) * out_k;
    float* wo = wt + size_t(r) * out_k;
    int kept = 0;
    for (int k = 0; valid && k < top_k && kept < out_k; ++k) {
      const int e = ss[k];
      if (e < lo || e >= lo + count) continue;
      bool seen = false;
      for (int j = 0; j < kept; ++j) seen = seen || so[j] == e - lo;
      if (seen) continue;
      so[kept] = e - lo;
      wo[kept] = sw[k];
      ++kept;
    }
    for (int k = kept; k < out_k; ++k) {
      so[k] = -1;
      wo[k] = 0.0f;
    }
  }
  if (valid)
    copy_row(reinterpret_cast<const __nv_bfloat16*>(slab + l.xq) + size_t(i) * dim,
             xq + size_t(r) * dim, dim);
}

__global__ void partial_sums_kernel(const int32_t* __restrict__ sel,
                                    const int32_t* __restrict__ pair_pos, int top_k,
                                    const __nv_bfloat16* __restrict__ ye, int dim,
                                    float* __restrict__ out) {
  __shared__ int s_order[kMaxTopK];
  const int r = blockIdx.x;
  // The one-rank combine's order (ops/cuda/moe/combine_order.cuh), so the sums are its own.
  if (threadIdx.x < top_k)
    cuda::moe::combine_order_slot(sel + size_t(r) * top_k, pair_pos + size_t(r) * top_k, top_k,
                                  threadIdx.x, s_order);
  __syncthreads();
  for (int c = threadIdx.x * 8; c < dim; c += blockDim.x * 8) {
    float acc[8];
    cuda::moe::combine_sum8(s_order, top_k, ye, size_t(dim), c, acc);
    float4* o = reinterpret_cast<float4*>(out + size_t(r) * dim + c);
    o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

__global__ void finish_kernel(const float* __restrict__ parts, int owners, int64_t stride,
                              const __nv_bfloat16* __restrict__ shared, int dim,
                              __nv_bfloat16* __restrict__ y) {
  const int r = blockIdx.x;
  for (int c = threadIdx.x * 2; c < dim; c += blockDim.x * 2) {
    float a0 = 0.0f, a1 = 0.0f;
    for (int o = 0; o < owners; ++o) {
      const float2 p = *reinterpret_cast<const float2*>(parts + (o * stride + r) * dim + c);
      a0 = __fadd_rn(a0, p.x);
      a1 = __fadd_rn(a1, p.y);
    }
    if (shared) {
      a0 = __fadd_rn(a0, __bfloat162float(shared[size_t(r) * dim + c]));
      a1 = __fadd_rn(a1, __bfloat162float(shared[size_t(r) * dim + c + 1]));
    } else {
      a0 = __fadd_rn(a0, 0.0f);
      a1 = __fadd_rn(a1, 0.0f);
    }
    *reinterpret_cast<__nv_bfloat162*>(y + size_t(r) * dim + c) = __floats2bfloat162_rn(a0, a1);
  }
}

}  // namespace

size_t slab_bytes(int cap, int top_k, int dim) {
  return layout(cap, top_k, dim).total;
}

void pack(const int32_t* sel, const float* wt, const __nv_bfloat16* xq, int m, int top_k, int dim,
          int cap, void* slab, cudaStream_t stream) {
  DSV4_CHECK(m >= 0 && m <= cap && dim % 8 == 0 && top_k >= 1 && top_k <= kMaxTopK,
             "exchange pack: ", m, " rows of capacity ", cap);
  pack_kernel<<<unsigned(std::max(m, 1)), kThreads, 0, stream>>>(sel, wt, xq, m, top_k, dim, cap,
                                                                 static_cast<uint8_t*>(slab));
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void select(const void* slabs, int ranks, int cap, int top_k, int dim, int lo, int count, int out_k,
            int32_t* sel, float* wt, __nv_bfloat16* xq, cudaStream_t stream) {
  DSV4_CHECK(ranks >= 1 && cap >= 1 && dim % 8 == 0 && top_k >= 1 && top_k <= kMaxTopK &&
                 out_k == std::min(top_k, count),
             "exchange select: bad shape");
  select_kernel<<<unsigned(ranks * cap), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(slabs), cap, top_k, dim, lo, count, out_k, sel, wt, xq);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void partial_sums(const int32_t* sel, const int32_t* pair_pos, int rows, int top_k,
                  const __nv_bfloat16* ye, int dim, float* out, cudaStream_t stream) {
  DSV4_CHECK(dim % 8 == 0 && top_k >= 1 && top_k <= kMaxTopK, "exchange partial sums: bad shape");
  if (rows == 0) return;
  partial_sums_kernel<<<unsigned(rows), kThreads, 0, stream>>>(sel, pair_pos, top_k, ye, dim, out);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void finish(const float* parts, int owners, int64_t part_stride, int m, const __nv_bfloat16* shared,
            int dim, __nv_bfloat16* y, cudaStream_t stream) {
  DSV4_CHECK(dim % 2 == 0 && owners >= 1, "exchange finish: bad shape");
  if (m == 0) return;
  finish_kernel<<<unsigned(m), kThreads, 0, stream>>>(parts, owners, part_stride, shared, dim, y);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsv4::exchange
