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

__global__ void __launch_bounds__(kCombineWarps * 32) sparse_attn_combine_kernel(const AttnArgs a) {
  sm90::griddep_wait();               // the attention grid has completed: its partials are visible
  sm90::griddep_launch_dependents();  // the next kernel (wo_a) may launch; it waits for us
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5);
  if (row >= int64_t(a.num_tokens) * a.n_heads) return;
  const int h = int(row % a.n_heads);
  const float* part = a.partials + row * a.num_splits * kPartialFloats;
  // Splits in groups of kCombineBatch: every load of a group is issued before its first use (one
  // L2 round trip a group, not one a split); the sums still run split by split in order, so the
  // bits do not depend on the grouping.
  constexpr int B = kCombineBatch;
  float M = -INFINITY;
  for (int s0 = 0; s0 < a.num_splits; s0 += B) {
    float m[B];
#pragma unroll
    for (int j = 0; j < B; ++j)
      m[j] = s0 + j < a.num_splits ? part[(s0 + j) * kPartialFloats + kHeadDim] : -INFINITY;
#pragma unroll
    for (int j = 0; j < B; ++j) M = fmaxf(M, m[j]);
  }
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.0f;
  __nv_bfloat16* out = a.out + row * kHeadDim;
  if (M == -INFINITY) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *reinterpret_cast<uint2*>(out + 128 * i + 4 * lane) = make_uint2(0, 0);
    return;
  }
  float L = 0.0f;
  for (int s0 = 0; s0 < a.num_splits; s0 += B) {
    float ms[B], ls[B];
    float4 v[B][4];
#pragma unroll
    for (int j = 0; j < B; ++j) {
      const bool in = s0 + j < a.num_splits;
      const float* ps = part + (s0 + j) * kPartialFloats;
      ms[j] = in ? ps[kHeadDim] : -INFINITY;
      ls[j] = in ? ps[kHeadDim + 1] : 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        v[j][i] = in ? *reinterpret_cast<const float4*>(ps + 128 * i + 4 * lane)
                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int j = 0; j < B; ++j) {
      if (ms[j] == -INFINITY) continue;  // an empty split, or past the last one
      const float f = exp2f(ms[j] - M);
      L += ls[j] * f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[4 * i + 0] += v[j][i].x * f;
        acc[4 * i + 1] += v[j][i].y * f;
        acc[4 * i + 2] += v[j][i].z * f;
        acc[4 * i + 3] += v[j][i].w * f;
      }
    }
  }
  L += exp2f(__ldg(a.sink + h) * 1.4426950408889634f - M);
  const float inv = 1.0f / L;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint2 v;
    v.x = sm90::pack_bf16x2(acc[4 * i] * inv, acc[4 * i + 1] * inv);
    v.y = sm90::pack_bf16x2(acc[4 * i + 2] * inv, acc[4 * i + 3] * inv);
    *reinterpret_cast<uint2*>(out + 128 * i + 4 * lane) = v;
  }
}

}  // namespace

void launch_combine(const AttnArgs& a, cudaStream_t stream) {
  const int64_t rows = int64_t(a.num_tokens) * a.n_heads;
  const int64_t blocks = (rows + kCombineWarps - 1) / kCombineWarps;
  // A programmatic dependent of the attention kernel: it waits for that grid before reading.
  launch_kernel(
      LaunchConfig{dim3(unsigned(blocks)), dim3(kCombineWarps * 32), 0, stream, /*pdl=*/true},
      sparse_attn_combine_kernel, a);
}

}  // namespace dsv4::cuda::sparse_attn_detail
