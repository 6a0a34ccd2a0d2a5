// The FP8 linears computed exactly as the reference does (W8A16): the activations quantised per
// (row, 128) to e4m3 with a UE8M0 scale (the reference's act_quant, same bytes as
// quantize_act_fp8) and decoded back to BF16 (exact: 4 significant bits x a power of two), the
// e4m3 weight decoded exactly to BF16 x its 128x128 UE8M0 scale, BF16 tensor-core products
// (exact in fp32) with fp32 accumulation, BF16 out.
//
// Why it exists beside fp8_gemm: Hopper's FP8 MMA keeps only ~14 bits while it sums inside a K
// block, so fp8_gemm's outputs sit within one BF16 ulp of the exact sums at ~99.3 % of elements
// and near-zero outputs can be several ulps off; one ulp before the next FP8 activation
// quantisation can move an e4m3 step downstream. The reference's sums are exact (the golden
// README: hc_pre and the MoE can be matched bit for bit), so layer-local agreement with it
// needs exact sums. This path reads the same FP8 weight bytes (plus 1/64 of them in prepared
// per-row scales) at BF16 tensor-core rates: the engine's --exact-linears.
//
// Kernels: the wo_a W8A16 kernels with one group and no RoPE (attn_output/wo_a_kernels.h): the
// weight-streaming mma.sync kernel for m <= 32 when k % 256 == 0, else the CUTLASS sm90
// mixed-input GEMM.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dsv4::cuda {

// x [m, k] (row stride ldx) -> xq [m, k] packed: each (row, 128) block quantised to e4m3 with
// its UE8M0 scale and decoded back, in BF16 (the values cpu::quantize_fp8 + dequantise give).
void fake_quant_act_bf16(const __nv_bfloat16* x, int64_t ldx, int m, int k, __nv_bfloat16* xq,
                         cudaStream_t stream);

// Elements of the per-row BF16 weight scales the tensor-core path reads (wo_a_prepare_scales
// with one group): [k/128, n].
size_t w8a16_scale_rows_elems(int n, int k);
void w8a16_prepare_scales(const uint8_t* w_scale_e8m0, int n, int k, __nv_bfloat16* scale_rows,
                          cudaStream_t stream);

struct W8A16LinearParams {
  const __nv_bfloat16* x = nullptr;  // [m, k], row stride ldx (0: k)
  int64_t ldx = 0;
  int m = 0;
  int n = 0;                                  // multiple of 128
  int k = 0;                                  // multiple of 128
  const uint8_t* w = nullptr;                 // e4m3 [n, k]
  const uint8_t* w_scale = nullptr;           // UE8M0 [n/128, k/128] (the checkpoint's)
  const __nv_bfloat16* scale_rows = nullptr;  // w8a16_prepare_scales output
  __nv_bfloat16* y = nullptr;                 // [m, n], row stride ldy (0: n)
  int64_t ldy = 0;
  __nv_bfloat16* xq = nullptr;  // workspace [m, k] BF16 (the quantised activations)
  bool quantize = true;         // false: x already holds quantised values (xq unused)
};
void w8a16_linear(const W8A16LinearParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
