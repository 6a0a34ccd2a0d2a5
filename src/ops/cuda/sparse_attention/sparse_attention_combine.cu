// Merges the split-KV partials of every (token, head): O = sum_s O_s 2^(m_s - M),
// L = sum_s l_s 2^(m_s - M) + 2^(sink - M) (M = max_s m_s), out = bf16(O / L); empty splits
// (m = -inf) contribute nothing; no valid key at all gives 0, as the reference's acc / inf.
// Launched as a programmatic dependent of the attention kernel (whose CTAs let it launch as they
// start): its launch overlaps the attention, and it waits for that grid's completion (and its
// partials) in griddep_wait before reading anything.
#include <cuda_bf16.h>

#include <cmath>

#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/sm90/bf16x2.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/sparse_attention/sparse_attention_config.h"
#include "ops/cuda/sparse_attention/sparse_attention_internal.h"

namespace dsv4::cuda::sparse_attn_detail {
namespace {

using namespace sparse_attn_cfg;

// One CTA a (token, head) row, warp w the value dims [128 w, 128 w + 128), lane 4 of them.
// The first kCombineGroup splits' partials (m, l and the lane's values) are loaded at once and
// kept in registers, so a row of at most kCombineGroup splits costs one round trip to L2 (the
// decode step's splits: ~10 at batch 1) — before, a pass over the maxima then one over the
// values, kCombineBatch = 4 splits a round trip each: 6 dependent round trips at 10 splits. The
// sums still run split by split in order after the maximum over all splits, so the bits are
// those of that kernel.
__global__ void __launch_bounds__(kCombineWarps * 32) sparse_attn_combine_kernel(const AttnArgs a) {
  static_assert(kCombineWarps * 128 == kHeadDim, "a warp per 128 value dims");
  sm90::griddep_wait();               // the attention grid has completed: its partials are visible
  sm90::griddep_launch_dependents();  // the next kernel (wo_a) may launch; it waits for us
  const int lane = threadIdx.x & 31, d = 128 * (threadIdx.x >> 5) + 4 * lane;
  const int64_t row = blockIdx.x;
  const int h = int(row % a.n_heads);
  const int ns = a.num_splits;
  const float* part = a.partials + row * ns * kPartialFloats;
  constexpr int G = kCombineGroup;
  // Splits s0 .. s0 + G - 1: every load issued before the first use (one L2 round trip);
  // splits past the last read as empty (m = -inf).
  auto load = [&](int s0, float(&m)[G], float(&l)[G], float4(&v)[G]) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const bool in = s0 + j < ns;
      const float* ps = part + (s0 + j) * kPartialFloats;
      m[j] = in ? ps[kHeadDim] : -INFINITY;
      l[j] = in ? ps[kHeadDim + 1] : 0.0f;
      v[j] = in ? *reinterpret_cast<const float4*>(ps + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  };
  float m0[G], l0[G];
  float4 v0[G];
  load(0, m0, l0, v0);
  float M = -INFINITY;
#pragma unroll
  for (int j = 0; j < G; ++j) M = fmaxf(M, m0[j]);
  for (int s0 = G; s0 < ns; s0 += G) {  // more splits: their maxima, a group a round trip
    float m[G];
#pragma unroll
    for (int j = 0; j < G; ++j)
      m[j] = s0 + j < ns ? part[(s0 + j) * kPartialFloats + kHeadDim] : -INFINITY;
#pragma unroll
    for (int j = 0; j < G; ++j) M = fmaxf(M, m[j]);
  }
  __nv_bfloat16* out = a.out + row * kHeadDim + d;
  if (M == -INFINITY) {
    *reinterpret_cast<uint2*>(out) = make_uint2(0, 0);
    return;
  }
  float L = 0.0f;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // A group's weighted sums, split by split in order.
  auto add = [&](const float(&m)[G], const float(&l)[G], const float4(&v)[G]) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
      if (m[j] == -INFINITY) continue;  // an empty split, or past the last one
      const float f = exp2f(m[j] - M);
      L += l[j] * f;
      acc[0] += v[j].x * f;
      acc[1] += v[j].y * f;
      acc[2] += v[j].z * f;
      acc[3] += v[j].w * f;
    }
  };
  add(m0, l0, v0);
  for (int s0 = G; s0 < ns; s0 += G) {
    float m[G], l[G];
    float4 v[G];
    load(s0, m, l, v);
    add(m, l, v);
  }
  L += exp2f(__ldg(a.sink + h) * 1.4426950408889634f - M);
  const float inv = 1.0f / L;
  uint2 o;
  o.x = sm90::pack_bf16x2(acc[0] * inv, acc[1] * inv);
  o.y = sm90::pack_bf16x2(acc[2] * inv, acc[3] * inv);
  *reinterpret_cast<uint2*>(out) = o;
}

}  // namespace

void launch_combine(const AttnArgs& a, cudaStream_t stream) {
  const int64_t rows = int64_t(a.num_tokens) * a.n_heads;  // a CTA each
  if (rows == 0) return;
  // A programmatic dependent of the attention kernel: it waits for that grid before reading.
  launch_kernel(
      LaunchConfig{dim3(unsigned(rows)), dim3(kCombineWarps * 32), 0, stream, /*pdl=*/true},
      sparse_attn_combine_kernel, a);
}

}  // namespace dsv4::cuda::sparse_attn_detail
