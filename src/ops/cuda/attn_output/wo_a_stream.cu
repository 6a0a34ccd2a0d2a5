// Weight-streaming W8A16 wo_a for small M (decode): the FP8 weight is read once, converted to
// BF16 in registers (exactly: e4m3 -> bf16 bit placement, x 2^120), multiplied on tensor cores
// (mma.sync m16n8k16, fp32 accumulation) and scaled per 128-wide K block in fp32 (a power of
// two: exact). The inverse RoPE of the activations is applied on their way from shared memory
// to the MMA fragments (none when cos_sin is null: the plain W8A16 linears of w8a16_linear.h).
//
// K permutation: within each 64-wide K chunk, thread c (= lane % 4) of a quad owns the 16
// contiguous K values [16c, 16c+16) of its rows and of its token; for MMA k-step s it feeds
// K values 16c+4s+{0,1} where the instruction expects k = 2c+{0,1} and 16c+4s+{2,3} where it
// expects 2c+8+{0,1}. Weights and activations use the same permutation, so the sum over K is
// unchanged while every thread reads 16 contiguous bytes per row.
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/attn_output/attn_output_config.h"
#include "ops/cuda/attn_output/wo_a_kernels.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/numerics.cuh"
#include "ops/cuda/common/sm90/cp_async.cuh"
#include "ops/cuda/common/sm90/gmem.cuh"
#include "ops/cuda/common/sm90/smem.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/common/sm90/warp_mma.cuh"

namespace dsv4::cuda {
namespace {

using namespace attn_output_cfg;

template <int kNT>
struct WsLayout {
  static constexpr int kTokens = 8 * kNT;
  static constexpr int kWBytes = kWsRows * kWsStageK;      // FP8 weights of a stage
  static constexpr int kABytes = kTokens * kWsStageK * 2;  // BF16 activations of a stage
  static constexpr int kStageBytes = kWBytes + kABytes;
  static constexpr int kBytes = kWsStages * kStageBytes;
  static_assert(kWBytes / 16 % kWsThreads == 0 && kABytes / 16 % kWsThreads == 0,
                "every thread issues whole 16-byte copies of a stage");
  static_assert(kBytes <= 227 * 1024, "shared memory");
};

__device__ __forceinline__ uint4 lds128(const uint8_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// Bytes (2*hi, 2*hi+1) of w (4 e4m3 codes) -> bf16x2, exact.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t w, bool hi) {
  uint32_t v;
  // Each 16-bit lane: the code in the low byte, its sign replicated in the high byte.
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(v) : "r"(w), "r"(hi ? 0xB3A2u : 0x9180u));
  // sign -> bit 15, exponent+mantissa -> bits 10..4: a bf16 of value code * 2^-120 (e4m3
  // subnormals land on bf16 subnormals with the same ratio).
  v = (v << 4) & 0x87f087f0u;
  const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(&v);
  const __nv_bfloat162 k2p120 =
      __halves2bfloat162(__ushort_as_bfloat16(0x7B80), __ushort_as_bfloat16(0x7B80));
  const __nv_bfloat162 r = __hmul2(x, k2p120);
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Inverse RoPE of 8 BF16 values (4 pairs starting at pair `pair0`) of token row cs.
__device__ __forceinline__ uint4 inv_rope8(uint4 v, const float2* cs) {
  float x[8];
  num::unpack8(v, x);
#pragma unroll
  for (int j = 0; j < 4; ++j) num::rope_pair(x[2 * j], x[2 * j + 1], cs[j], true);
  return num::pack8(x);
}

template <int kNT>
__global__ void __launch_bounds__(kWsThreads) wo_a_stream_kernel(WoAArgs p) {
  using L = WsLayout<kNT>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int rw = warp % kWsWarps;    // row warp: rows 16 rw .. 16 rw + 15 of the CTA
  const int kset = warp / kWsWarps;  // K set: the stage's 128-wide block kset
  const int K = p.in_g;
  const int row0 = blockIdx.x * kWsRows;  // global weight row
  const int group = row0 / p.o_lora;
  const uint8_t* wbase = p.w + int64_t(row0) * K;
  const __nv_bfloat16* abase = p.o + int64_t(group) * K;
  const int n_iter = K / kWsStageK;
  const int kblocks = K / 128;
  const uint8_t* wscale = p.w_scale + int64_t(row0 / 128) * kblocks;
  // The CTA's weight rows (one contiguous kWsRows x K block) into L2 before the wait: launched
  // programmatically (p.pdl), the stream starts while the kernel before finishes. Then nothing
  // is read before that kernel is complete; the next kernel may launch at once.
  if (tid < kWsPrefetchParts) {
    const int64_t part = int64_t(kWsRows) * K / kWsPrefetchParts;  // a multiple of 16 bytes
    sm90::prefetch_l2_bulk(wbase + tid * part, uint32_t(part));
  }
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();

  auto stage_w = [&](int slot) { return smem + slot * L::kStageBytes; };
  auto stage_a = [&](int slot) { return smem + slot * L::kStageBytes + L::kWBytes; };

  auto load_stage = [&](int slot, int it) {
    const int k0 = it * kWsStageK;
    const uint32_t sw = sm90::smem_u32(stage_w(slot)), sa = sm90::smem_u32(stage_a(slot));
#pragma unroll
    for (int i = 0; i < L::kWBytes / 16 / kWsThreads; ++i) {
      const int u = tid + i * kWsThreads, r = u / 16, q = u % 16;
      sm90::cp_async_16_zfill(sw + r * kWsStageK + ((q ^ ((r & 1) << 2)) * 16),
                              wbase + int64_t(r) * K + k0 + 16 * q, 16);
    }
#pragma unroll
    for (int i = 0; i < L::kABytes / 16 / kWsThreads; ++i) {
      const int u = tid + i * kWsThreads, m = u / 32, q = u % 32;
      const bool valid = m < p.num_tokens;
      const __nv_bfloat16* src = abase + int64_t(valid ? m : 0) * p.ldo + k0 + 8 * q;
      sm90::cp_async_16_zfill(sa + m * (kWsStageK * 2) + ((q ^ (m & 1)) * 16), src, valid ? 16 : 0);
    }
  };

  float acc[kNT][4], part[kNT][4];
#pragma unroll
  for (int j = 0; j < kNT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = part[j][i] = 0.0f;

#pragma unroll
  for (int s = 0; s < kWsStages - 1; ++s) {
    if (s < n_iter) load_stage(s, s);
    sm90::cp_async_commit();
  }

  const int r_lo = 16 * rw + g;  // this thread's A rows: r_lo and r_lo + 8
  for (int it = 0; it < n_iter; ++it) {
    sm90::cp_async_wait<kWsStages - 2>();
    __syncthreads();
    if (it + kWsStages - 1 < n_iter)
      load_stage((it + kWsStages - 1) % kWsStages, it + kWsStages - 1);
    sm90::cp_async_commit();

    const uint8_t* sw = stage_w(it % kWsStages);
    const uint8_t* sa = stage_a(it % kWsStages);
#pragma unroll
    for (int ch = 2 * kset; ch < 2 * kset + 2; ++ch) {
      const int kg = it * kWsStageK + 64 * ch;  // K offset of the chunk within the group
      const uint4 w0 = lds128(sw + r_lo * kWsStageK + (((4 * ch + c) ^ ((r_lo & 1) << 2)) * 16));
      const uint4 w1 =
          lds128(sw + (r_lo + 8) * kWsStageK + (((4 * ch + c) ^ ((r_lo & 1) << 2)) * 16));
      uint4 act[kNT][2];
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const int n = 8 * j + g;
        const uint8_t* row = sa + n * (kWsStageK * 2);
        act[j][0] = lds128(row + (((8 * ch + 2 * c) ^ (n & 1)) * 16));
        act[j][1] = lds128(row + (((8 * ch + 2 * c + 1) ^ (n & 1)) * 16));
        if (p.cos_sin != nullptr && kg % 512 == 448 && n < p.num_tokens) {
          // Dims 448 + 16c .. +15 of a head: RoPE pairs 8c .. 8c+7.
          const float2* cs = p.cos_sin + int64_t(n) * 32 + 8 * c;
          float2 cs0[4], cs1[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            cs0[q] = cs[q];
            cs1[q] = cs[4 + q];
          }
          act[j][0] = inv_rope8(act[j][0], cs0);
          act[j][1] = inv_rope8(act[j][1], cs1);
        }
      }
      const uint32_t wa[4] = {w0.x, w0.y, w0.z, w0.w}, wb[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t a[4] = {e4m3x2_to_bf16x2(wa[s], false), e4m3x2_to_bf16x2(wb[s], false),
                               e4m3x2_to_bf16x2(wa[s], true), e4m3x2_to_bf16x2(wb[s], true)};
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
          const uint32_t bw[8] = {act[j][0].x, act[j][0].y, act[j][0].z, act[j][0].w,
                                  act[j][1].x, act[j][1].y, act[j][1].z, act[j][1].w};
          sm90::mma_bf16_16816(part[j], a, bw[2 * s], bw[2 * s + 1]);
        }
      }
      if (ch % 2 == 1) {  // end of a 128-wide K block: acc += part * 2^e (exact product)
        const float sc = num::e8m0_to_float(__ldg(wscale + kg / 128));
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[j][i] = __fmaf_rn(part[j][i], sc, acc[j][i]);
            part[j][i] = 0.0f;
          }
      }
    }
  }
  sm90::cp_async_wait<0>();
  // The K sets' sums, added in set order (set 0 + set 1 + ...) by set 0 through the idle ring.
  static_assert(kWsKSplit * kWsWarps * 32 * kNT * 4 * 4 <= L::kBytes, "epilogue scratch");
  __syncthreads();  // every warp is past its last read of the ring
  float* red = reinterpret_cast<float*>(smem);
  const int slot = (rw * 32 + lane) * kNT * 4;  // this (row warp, lane)'s kNT * 4 sums
  if (kset > 0) {
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        red[(kset - 1) * kWsWarps * 32 * kNT * 4 + slot + j * 4 + i] = acc[j][i];
  }
  __syncthreads();
  if (kset > 0) return;
#pragma unroll
  for (int h = 1; h < kWsKSplit; ++h)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        acc[j][i] += red[(h - 1) * kWsWarps * 32 * kNT * 4 + slot + j * 4 + i];

  // D fragment: (row r_lo, tokens 8j+2c, +1) and (row r_lo+8, same tokens).
  const int row = row0 + r_lo;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const int t0 = 8 * j + 2 * c;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = t0 + (i & 1), r = row + (i >> 1) * 8;
      if (t < p.num_tokens) p.z[int64_t(t) * p.ldz + r] = __float2bfloat16_rn(acc[j][i]);
    }
  }
}

template <int kNT>
void launch_stream(const WoAArgs& a, cudaStream_t stream) {
  using L = WsLayout<kNT>;
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(wo_a_stream_kernel<kNT>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes));
  const int ctas = a.o_groups * a.o_lora / kWsRows;
  launch_kernel(
      LaunchConfig{dim3(unsigned(ctas)), dim3(kWsThreads), size_t(L::kBytes), stream, a.pdl},
      wo_a_stream_kernel<kNT>, a);
}

}  // namespace

void wo_a_weight_stream(const WoAArgs& a, cudaStream_t stream) {
  if (a.num_tokens <= 8)
    launch_stream<1>(a, stream);
  else if (a.num_tokens <= 16)
    launch_stream<2>(a, stream);
  else if (a.num_tokens <= 32)
    launch_stream<4>(a, stream);
  else
    launch_stream<8>(a, stream);
}

}  // namespace dsv4::cuda
