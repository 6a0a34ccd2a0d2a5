// Activation quantisation for the FP8 GEMMs (the reference's act_quant with block 128, bytes
// identical to cpu::quantize_fp8), and the one-off conversion of checkpoint weight scales.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/gemm/act_quant.cuh"
#include "ops/cuda/gemm/fp8_gemm.h"

namespace dsv4::cuda {
namespace {

constexpr int kQuantThreads = 256;  // 8 warps; a half-warp quantises one 128-element block
// From kQuantDeepBlocks blocks a warp loads kQuantDeepLoads pairs of consecutive blocks before
// quantising the first (2 KB a warp in flight; one pair at a time held 512 B: 71 us for the 8K
// prefill's wo_b input, ~2.8 TB/s); below, one pair a warp (decode: the most CTAs, the shortest
// chain; four pairs took 7.8 us at one token against 1.8).
constexpr int kQuantDeepLoads = 4;
constexpr int64_t kQuantDeepBlocks = 32768;

template <int kLoads>
__global__ void __launch_bounds__(kQuantThreads) act_quant_kernel(ActQuantParams p) {
  // The GEMM that consumes these codes may start launching (it waits for our completion
  // before it reads them).
  sm90::griddep_launch_dependents();
  // Launched programmatically (p.pdl), x is read only once the kernel before is complete.
  sm90::griddep_wait();
  const int kb_per_row = p.k / 128;
  const int64_t blocks = int64_t(p.m) * kb_per_row;
  const int64_t ldx = p.ldx ? p.ldx : p.k;
  const int half = (threadIdx.x & 31) >> 4;  // which half-warp: one block each
  const int hl = threadIdx.x & 15;           // lane inside the half-warp: 8 elements each
  const int64_t warp_id = (int64_t(blockIdx.x) * kQuantThreads + threadIdx.x) / 32;
  const int64_t warps = int64_t(gridDim.x) * kQuantThreads / 32;
  constexpr int kWarpBlocks = 2 * kLoads;
  // The loop bound is uniform over the warp (the shuffles need all 32 lanes).
  for (int64_t wb = warp_id * kWarpBlocks; wb < blocks; wb += warps * kWarpBlocks) {
    uint4 raw[kLoads];
    int64_t row[kLoads];
    int kb[kLoads];
#pragma unroll
    for (int q = 0; q < kLoads; ++q) {
      const int64_t blk = wb + 2 * q + half;
      row[q] = blk / kb_per_row;
      kb[q] = int(blk - row[q] * kb_per_row);
      raw[q] = make_uint4(0, 0, 0, 0);
      if (blk < blocks)
        raw[q] = __ldg(
            reinterpret_cast<const uint4*>(p.x + row[q] * ldx + int64_t(kb[q]) * 128 + hl * 8));
    }
#pragma unroll
    for (int q = 0; q < kLoads; ++q) {
      const bool valid = wb + 2 * q + half < blocks;  // uniform over each half-warp
      const __nv_bfloat16* xv = reinterpret_cast<const __nv_bfloat16*>(&raw[q]);
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(xv[i]);
      uint32_t e = 0;
      const uint2 codes = act_quant::quantize_block8(v, e);
      if (!valid) continue;
      *reinterpret_cast<uint2*>(p.codes + row[q] * p.k + int64_t(kb[q]) * 128 + hl * 8) = codes;
      if (hl == 0) {
        // With the pad rows up to fp8_scale_ld(m) (ld_scales >= that) as 0: the tensor-core GEMM
        // reads them (fp8_gemm_prefill.cu, sfa_rows) and they should not be whatever the
        // workspace held.
        act_quant::store_block_scale(p.scales_t, p.ld_scales, kb[q], row[q], p.m, e);
        if (p.scales_e8m0) p.scales_e8m0[row[q] * kb_per_row + kb[q]] = uint8_t(e);
      }
    }
  }
}

__global__ void weight_scales_kernel(const uint8_t* e8m0, int nb, int kb, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= nb * kb) return;
  const int r = i / kb, c = i % kb;  // checkpoint [nb, kb] -> transposed [kb, nb]
  const uint32_t code = e8m0[i];
  // 2^(code-127); code 0 is 2^-127 (subnormal), 255 is NaN.
  out[int64_t(c) * nb + r] = code == 255u ? __uint_as_float(0x7fc00000u)
                             : code == 0u ? __uint_as_float(0x00400000u)
                                          : __uint_as_float(code << 23);
}

}  // namespace

void quantize_act_fp8(const ActQuantParams& p, cudaStream_t stream) {
  DSV4_CHECK(p.m >= 0 && p.k > 0 && p.k % 128 == 0, "quantize_act_fp8: k = ", p.k,
             " must be a positive multiple of 128 (m = ", p.m, ")");
  DSV4_CHECK(p.ld_scales >= p.m && p.ld_scales % 4 == 0, "quantize_act_fp8: ld_scales ",
             p.ld_scales, " must be >= m (", p.m, ") and a multiple of 4");
  const int64_t ldx = p.ldx ? p.ldx : p.k;
  DSV4_CHECK(ldx >= p.k && ldx % 8 == 0, "quantize_act_fp8: row stride ", ldx,
             " must be >= k and a multiple of 8");
  if (p.m == 0) return;
  DSV4_CHECK(p.x && p.codes && p.scales_t, "quantize_act_fp8: null pointer");
  DSV4_CHECK(
      reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && reinterpret_cast<uintptr_t>(p.codes) % 16 == 0,
      "quantize_act_fp8: x and codes must be 16-byte aligned");
  const int64_t blocks = int64_t(p.m) * (p.k / 128);
  const bool deep = blocks >= kQuantDeepBlocks;
  const int64_t per_cta = kQuantThreads / 32 * 2 * (deep ? kQuantDeepLoads : 1);  // an iteration
  const int grid = int(std::min<int64_t>((blocks + per_cta - 1) / per_cta, 1 << 20));
  LaunchConfig cfg;
  cfg.grid = dim3(unsigned(grid), 1, 1);
  cfg.block = dim3(kQuantThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = p.pdl;
  launch_kernel(cfg, deep ? act_quant_kernel<kQuantDeepLoads> : act_quant_kernel<1>, p);
}

void fp8_weight_scales_to_f32(const uint8_t* e8m0, int n, int k, float* scales_t,
                              cudaStream_t stream) {
  DSV4_CHECK(n > 0 && k > 0 && k % 128 == 0, "fp8_weight_scales_to_f32: bad shape [", n, ", ", k,
             "]");
  DSV4_CHECK(e8m0 && scales_t, "fp8_weight_scales_to_f32: null pointer");
  const int nb = (n + 127) / 128, kb = k / 128;
  weight_scales_kernel<<<(nb * kb + 255) / 256, 256, 0, stream>>>(e8m0, nb, kb, scales_t);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsv4::cuda
