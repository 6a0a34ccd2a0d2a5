// FP8 block-scaled GEMM for every FP8 linear of DeepSeek-V4 (wq_a, wq_b, wkv, wo_b, indexer
// wq_b, shared experts w1/w3/w2, MTP e_proj/h_proj), with the reference numerics of
// cpu::linear(LinearKind::kFp8) (ops/cpu/linear.h):
//   1. activations x (BF16 [m, k]) are quantised per (row, 128) block to e4m3 with a power-of-two
//      (UE8M0) scale — bytes identical to cpu::quantize_fp8 (quantize_act_fp8 below);
//   2. y[m, n] = bf16( sum over 128-wide K blocks b of  sa[m, b] * sw[n/128, b] *
//                      (fp32 dot of the e4m3 codes of block b) ), the per-block partial sums
//      promoted into an fp32 accumulator.
// Weights stay in the checkpoint layout: e4m3 codes [n, k] row-major; their 128x128 UE8M0 scales
// are converted once at load time to fp32, transposed (fp8_weight_scales_to_f32).
//
// Two kernels, picked by fp8_gemm_pick_path (fp8_gemm_heuristic.h):
//  * stream (m <= 64; up to 256 rows for n not a multiple of 8): weight-streaming
//    swap-AB wgmma kernel; each CTA streams 128 weight rows x a K range through a TMA pipeline
//    for up to 64 tokens (blocks of 64 above), K split across a thread-block cluster whose CTAs
//    reduce through distributed shared memory (deterministic, no workspace). Any n >= 1. Each
//    32-wide K slice is promoted into fp32 separately (exact FP8 products; no tensor-core
//    accumulation chain), so it matches the CPU to fp32 rounding. A weight's K split does not
//    depend on m, so neither does a token's output while its GEMM streams.
//  * tensor-core (m > 64): CUTLASS's sm90 warp-specialised FP8 blockwise-scaled GEMM
//    (1x128 activation scales, 128x128 weight scales, fp32 scales), persistent or stream-K.
//    Needs n % 8 == 0. Its promotion interval is the 128 block: inside a block the FP8 tensor
//    cores chain four 32-wide slices in their ~14-bit accumulator (as DeepGEMM and the
//    reference's kernels do), a relative error of order 1e-4 of the output's scale.
// Both need k % 128 == 0 and 16-byte aligned pointers.
//
// Typical use (e.g. the shared expert's w1):
//   // load time, once per weight: fp32 transposed scales [k/128, ceil(n/128)]
//   fp8_weight_scales_to_f32(scale_e8m0, n, k, w_scales_f32, stream);
//   const Fp8WeightView w{codes, w_scales_f32, n, k};
//   // a device workspace of fp8_linear_workspace_bytes_upto(m_max, n, k) bytes (any content;
//   // one per stream: it holds the quantised activations), good for every m <= m_max
//   Fp8LinearParams p;
//   p.x = x; p.m = m; p.w = w; p.y = y; p.workspace = ws; p.workspace_bytes = ws_bytes;
//   fp8_linear(p, stream);   // quantize_act_fp8, then fp8_gemm (launched with PDL)
// fp8_gemm_grouped multiplies one quantised input by several weights in one launch (below).
// Everything is stream-ordered and graph-capturable (no allocation, no synchronisation); the
// first call per kernel variant sets function attributes, so warm up before capturing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dsv4::cuda {

// ---- activation quantisation -------------------------------------------------------------
// Leading dimension of the transposed fp32 activation scales for m rows: m rounded up to 4. The
// tensor-core GEMM loads each K block's scales with TMA as a column of fp8_scale_ld(m) floats
// (16-byte multiple, as CUTLASS requires), so rows [m, fp8_scale_ld(m)) must exist; they only
// scale rows that are never stored, and quantize_act_fp8 writes them as 0.
inline int fp8_scale_ld(int m) {
  return (m + 3) / 4 * 4;
}

struct ActQuantParams {
  const __nv_bfloat16* x = nullptr;  // [m, k], row stride ldx elements (0: k)
  int m = 0;
  int k = 0;  // multiple of 128
  int64_t ldx = 0;
  uint8_t* codes = nullptr;        // [m, k] e4m3, row-major, packed
  float* scales_t = nullptr;       // fp32 [k/128, ld_scales]: block b of row r at b*ld + r;
                                   // rows [m, fp8_scale_ld(m)) are written as 0
  int ld_scales = 0;               // >= m, multiple of 4 (fp8_scale_ld(m))
  uint8_t* scales_e8m0 = nullptr;  // optional: UE8M0 [m, k/128] (cpu::quantize_fp8's scales)
  // Launch with programmatic dependent launch: the kernel starts while the one before on the
  // stream finishes and reads x only after griddepcontrol.wait (graph-capturable).
  bool pdl = false;
};
// amax = max(max|x|, 1e-4); s = pow2_ceil(amax * (1/448)); q = e4m3_rne_sat(x / s).
void quantize_act_fp8(const ActQuantParams& p, cudaStream_t stream);

// ---- weights -----------------------------------------------------------------------------
struct Fp8WeightView {
  const uint8_t* codes = nullptr;  // e4m3 [n, k] row-major (the checkpoint layout)
  const float* scales_t =
      nullptr;  // fp32 [k/128, ceil(n/128)]: block (nb, kb) at kb*ceil(n/128)+nb
  int n = 0;
  int k = 0;
};
// Checkpoint scales UE8M0 [ceil(n/128), k/128] -> fp32 transposed (the layout above).
void fp8_weight_scales_to_f32(const uint8_t* e8m0, int n, int k, float* scales_t,
                              cudaStream_t stream);

// ---- GEMM on quantised activations -----------------------------------------------------------
enum class Fp8GemmPath { kAuto, kStream, kTensorCore };

struct Fp8GemmParams {
  const uint8_t* a_codes = nullptr;  // [m, k] e4m3 (quantize_act_fp8's codes)
  // [k/128, a_ld_scales] fp32. Rows [m, fp8_scale_ld(m)) are read too; any value there (even
  // NaN) leaves y unchanged: they scale only rows that are never stored.
  const float* a_scales_t = nullptr;
  int a_ld_scales = 0;  // >= m, multiple of 4
  int m = 0;
  Fp8WeightView w;
  __nv_bfloat16* y = nullptr;  // [m, n], row stride ldy elements (0: n)
  int64_t ldy = 0;
  void* workspace = nullptr;  // fp8_gemm_workspace_bytes(m, n, k) bytes, any content
  size_t workspace_bytes = 0;
  // Launch the streaming kernel with programmatic dependent launch: it starts
  // streaming weights while the kernel that writes a_codes/a_scales_t (the one launched just
  // before on the same stream) finishes. Ignored by the tensor-core path.
  bool pdl = false;
  Fp8GemmPath path = Fp8GemmPath::kAuto;
};
size_t fp8_gemm_workspace_bytes(int m, int n, int k, Fp8GemmPath path = Fp8GemmPath::kAuto);
void fp8_gemm(const Fp8GemmParams& p, cudaStream_t stream);

// ---- grouped GEMM: several weights, one input ---------------------------------------------------
// y_g = x W_g^T for up to kMaxGroups weights with the same k, on the same quantised activations
// (e.g. the attention's wq_a and wkv on the normalised x; wq_b and the indexer's wq_b on the
// normalised q latent). Where every weight streams and one launch is predicted faster than
// theirs (plan_stream_grouping, fp8_gemm_heuristic.h; always with a forced split), all of them
// run in one launch whose K split is planned over their tiles together; each y_g is
// bit-identical to the streaming GEMM of W_g alone at the same split (the split changes only
// the order of the fp32 sum of the K-range partials). Otherwise each weight is its own fp8_gemm
// launch, exactly fp8_gemm. The workspace covers the largest weight's fp8_gemm_workspace_bytes
// (the launches are in order).
struct Fp8GemmGroupedParams {
  static constexpr int kMaxGroups = 4;
  const uint8_t* a_codes = nullptr;
  const float* a_scales_t = nullptr;
  int a_ld_scales = 0;
  int m = 0;
  int count = 0;  // 1..kMaxGroups
  Fp8WeightView w[kMaxGroups];
  __nv_bfloat16* y[kMaxGroups] = {};
  int64_t ldy[kMaxGroups] = {};  // 0: that weight's n
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool pdl = false;  // as Fp8GemmParams::pdl, for the one streaming launch
  Fp8GemmPath path = Fp8GemmPath::kAuto;
  int splits = 0;  // streaming path: 0 = the heuristic's K split; tests force one
  // >= 0: only weight `only` of the group, as its own launch, computing exactly what the whole
  // group's call gives it (in a grouped launch: alone at the group's split), so that the
  // weights of a group may run apart (on two streams) with the grouped call's bits.
  int only = -1;
};
void fp8_gemm_grouped(const Fp8GemmGroupedParams& p, cudaStream_t stream);

// ---- quantise + GEMM ---------------------------------------------------------------------------
struct Fp8LinearParams {
  const __nv_bfloat16* x = nullptr;  // [m, k] BF16, row stride ldx (0: k)
  int64_t ldx = 0;
  int m = 0;
  Fp8WeightView w;
  __nv_bfloat16* y = nullptr;  // [m, n], row stride ldy (0: n)
  int64_t ldy = 0;
  void* workspace = nullptr;  // fp8_linear_workspace_bytes(m, n, k) bytes, any content
  size_t workspace_bytes = 0;
  Fp8GemmPath path = Fp8GemmPath::kAuto;
};
size_t fp8_linear_workspace_bytes(int m, int n, int k, Fp8GemmPath path = Fp8GemmPath::kAuto);
// The largest fp8_linear_workspace_bytes over 1 <= m <= m_max (automatic path).
size_t fp8_linear_workspace_bytes_upto(int m_max, int n, int k);
void fp8_linear(const Fp8LinearParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
