// Indexer query path: RoPE (last 64 dims) -> Hadamard 128 -> FP4 fake-quant per 32, and the
// head weights. Bit-identical to the CPU ops: every fp32 operation is the same IEEE operation
// in the same order (explicit _rn intrinsics, so nothing is contracted into an FMA).
#include <cuda_bf16.h>

#include <cmath>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/sm90/bf16x2.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/indexer/indexer.h"
#include "ops/cuda/indexer/indexer_config.h"
#include "ops/cuda/indexer/indexer_internal.h"
#include "ops/cuda/sparse_attention/decode.cuh"

namespace dsv4::cuda {
namespace {

using namespace indexer_cfg;

__device__ __forceinline__ float round_bf16(float x) {
  return sm90::bf16_bits_to_float(sm90::float_to_bf16_bits(x));
}

// 2^ceil(log2(v)) from the IEEE bits, as dsv4::pow2_ceil.
__device__ __forceinline__ float pow2_ceil_dev(float v) {
  const uint32_t bits = __float_as_uint(v);
  const int e = int((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
  return __uint_as_float(uint32_t(e + 127) << 23);
}

// Nearest-even e2m1 magnitude code of a in [0, 6] (ties to the even code, as round_to_table).
__device__ __forceinline__ int e2m1_mag_code(float a) {
  if (a <= 0.25f) return 0;
  if (a < 0.75f) return 1;
  if (a <= 1.25f) return 2;
  if (a < 1.75f) return 3;
  if (a <= 2.5f) return 4;
  if (a < 3.5f) return 5;
  if (a <= 5.0f) return 6;
  return 7;
}

__device__ __forceinline__ float e2m1_mag_value(int c) {
  // {0, .5, 1, 1.5, 2, 3, 4, 6}
  return c < 4 ? 0.5f * float(c) : float(1 << (c / 2 - 1)) * (c & 1 ? 1.5f : 1.0f);
}

// One head row of token t by the calling warp: RoPE (cs: the lane's two pairs, lanes >= 16),
// Hadamard, FP4 fake-quantisation; lane l holds elements 4l .. 4l+3.
__device__ __forceinline__ uint2 query_row(uint2 raw, const float2 (&cs)[2], float had_scale,
                                           int lane) {
  float x[4] = {sm90::bf16lo_to_float(raw.x), sm90::bf16hi_to_float(raw.x),
                sm90::bf16lo_to_float(raw.y), sm90::bf16hi_to_float(raw.y)};

  // RoPE on dims 64..127: pairs (64 + 2i, 65 + 2i); lane l >= 16 holds pairs i = 2l-32, 2l-31.
  if (lane >= 16) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float c = cs[k].x, sn = cs[k].y;
      const float a = x[2 * k], b = x[2 * k + 1];
      x[2 * k] = round_bf16(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sn)));
      x[2 * k + 1] = round_bf16(__fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, c)));
    }
  }

  // Walsh-Hadamard, Sylvester order, strides 1, 2, ..., 64 as cpu::hadamard_rotate:
  // (x[j], x[j+h]) <- (x[j] + x[j+h], x[j] - x[j+h]).
  {
    float a, b;
    a = x[0], b = x[1], x[0] = __fadd_rn(a, b), x[1] = __fsub_rn(a, b);
    a = x[2], b = x[3], x[2] = __fadd_rn(a, b), x[3] = __fsub_rn(a, b);
    a = x[0], b = x[2], x[0] = __fadd_rn(a, b), x[2] = __fsub_rn(a, b);
    a = x[1], b = x[3], x[1] = __fadd_rn(a, b), x[3] = __fsub_rn(a, b);
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {  // element stride 4m
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float other = __shfl_xor_sync(0xffffffffu, x[j], m);
      x[j] = upper ? __fsub_rn(other, x[j]) : __fadd_rn(x[j], other);
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) x[j] = round_bf16(__fmul_rn(x[j], had_scale));

  // FP4 fake-quant per 32 values (8 lanes): s = 2^ceil(log2(max(amax, 6*2^-126) * (1/6))).
  float amax = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
  constexpr float kFloor = 6.0f * 1.1754943508222875e-38f;
  constexpr float kInv6 = 1.0f / 6.0f;
  const float sc = pow2_ceil_dev(__fmul_rn(fmaxf(amax, kFloor), kInv6));
  uint16_t outb[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float v = __fdiv_rn(x[j], sc);
    v = v < -6.0f ? -6.0f : (6.0f < v ? 6.0f : v);
    const float mag = e2m1_mag_value(e2m1_mag_code(fabsf(v)));
    const float qv = __fmul_rn(signbit(v) ? -mag : mag, sc);
    outb[j] = sm90::float_to_bf16_bits(qv);
  }
  uint2 o;
  o.x = uint32_t(outb[0]) | (uint32_t(outb[1]) << 16);
  o.y = uint32_t(outb[2]) | (uint32_t(outb[3]) << 16);
  return o;
}

template <int kRows>
__global__ void __launch_bounds__(kQueryWarps * 32)
    indexer_query_kernel(const __nv_bfloat16* __restrict__ q,
                         const __nv_bfloat16* __restrict__ wproj,
                         const int32_t* __restrict__ cu_seqlens,
                         const int32_t* __restrict__ seq_pos0, int num_seqs, int n_heads,
                         const float* __restrict__ inv_freq, float had_scale, float w_scale,
                         __nv_bfloat16* __restrict__ q_out, __nv_bfloat16* __restrict__ w_out) {
  static_assert(kRopePairs == 32, "one pair a lane of warp 0; two a lane of lanes 16..31");
  __shared__ float2 s_cs[kRopePairs];
  // Launched programmatically (IndexerParams::pdl): nothing is read before the kernel before
  // is complete.
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x, h0 = blockIdx.y * kQueryWarps * kRows;
  if (warp == 0) {
    // cos / sin of pair i = lane at the token's position, as the per-head code computed them:
    // the fp32 angle, then sincos in double rounded to float.
    const int s = detail::seq_of_token(cu_seqlens, num_seqs, t);
    const int pos = __ldg(seq_pos0 + s) + (t - __ldg(cu_seqlens + s));
    const float angle = __fmul_rn(float(pos), __ldg(inv_freq + lane));
    double sd, cd;
    sincos(double(angle), &sd, &cd);
    s_cs[lane] = make_float2(float(cd), float(sd));
  }
  uint2 raw[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int h = h0 + warp + r * kQueryWarps;
    raw[r] =
        h < n_heads
            ? *reinterpret_cast<const uint2*>(q + (size_t(t) * n_heads + h) * kHeadDim + 4 * lane)
            : make_uint2(0, 0);
  }
  __syncthreads();
  float2 cs[2] = {make_float2(0.f, 0.f), make_float2(0.f, 0.f)};
  if (lane >= 16) cs[0] = s_cs[2 * lane - 32], cs[1] = s_cs[2 * lane - 31];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int h = h0 + warp + r * kQueryWarps;
    if (h >= n_heads) break;  // warp-uniform
    const size_t row = (size_t(t) * n_heads + h) * kHeadDim;
    *reinterpret_cast<uint2*>(q_out + row + 4 * lane) = query_row(raw[r], cs, had_scale, lane);
    if (lane == 0) {
      const float wv = __bfloat162float(wproj[size_t(t) * n_heads + h]);
      w_out[size_t(t) * n_heads + h] = __float2bfloat16_rn(__fmul_rn(wv, w_scale));
    }
  }
}

}  // namespace

void indexer_query(const IndexerParams& p, cudaStream_t stream) {
  indexer_detail::validate(p, indexer_detail::Stage::kQuery);
  if (p.batch.num_tokens == 0) return;
  // The reference's scales, computed in double and rounded once (cpu::hadamard_rotate,
  // CpuModel::attention).
  const float had_scale = static_cast<float>(1.0 / std::sqrt(double(kHeadDim)));
  const float w_scale =
      static_cast<float>(1.0 / std::sqrt(double(kHeadDim)) / std::sqrt(double(p.n_heads)));
  const bool prefill = p.batch.num_tokens >= kQueryPrefillTokens;
  const int rows = prefill ? kQueryRowsPrefill : 1;
  const dim3 grid(unsigned(p.batch.num_tokens),
                  unsigned((p.n_heads + kQueryWarps * rows - 1) / (kQueryWarps * rows)));
  const LaunchConfig cfg{grid, dim3(kQueryWarps * 32), 0, stream, p.pdl};
  auto kernel = prefill ? indexer_query_kernel<kQueryRowsPrefill> : indexer_query_kernel<1>;
  launch_kernel(cfg, kernel, p.q, p.wproj, p.batch.cu_seqlens, p.batch.seq_pos0, p.batch.num_seqs,
                p.n_heads, p.inv_freq, had_scale, w_scale, p.q_fp4, p.weights);
}

}  // namespace dsv4::cuda
