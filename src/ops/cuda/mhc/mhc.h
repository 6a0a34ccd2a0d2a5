// Manifold-constrained hyper-connections on the GPU, with the numerics of cpu::hc_pre /
// cpu::hc_post / cpu::hc_head (ops/cpu/mhc.h, spec §4). Streams are BF16 [tokens, hc, dim];
// mixing parameters fp32 in the checkpoint layout.
//
//  * hc_pre      : streams -> y = bf16(sum_j pre_j h_j) [tokens, dim] (optionally RMS-normalised
//                  with the sub-layer's norm weight, i.e. attn_norm/ffn_norm fused), post [tokens,
//                  hc], comb [tokens, hc, hc] (Sinkhorn-normalised, row j -> column k).
//  * hc_post     : out_k = bf16(post_k x + sum_j comb[j][k] res_j) (unfused, elementwise).
//  * hc_post_pre : hc_post of one sub-layer fused with hc_pre of the next (vLLM's
//                  mhc_fused_post_pre): each token's streams are read once, the new streams
//                  written once, and the next sub-layer's input produced in the same pass.
//                  On the cluster path, used while a cluster tile holds one m-tile; for more
//                  tokens the streaming hc_post followed by hc_pre is faster (the fused
//                  kernel's hc_post runs on one CTA per SM in series with the rest of the
//                  tile) and is what runs, with bit-identical results. On the split path
//                  the projection kernel computes and writes the new streams of its
//                  slice and the finishing kernel reads them back (from L2) for the collapse.
//  * hc_head     : y = bf16(sum_j w_j h_j) with w_j = sigmoid(m_j scale + base_j) + eps
//                  (optionally followed by the final RMSNorm).
//
// Widths that are a multiple of 32 up to mhc_cfg::kSplitMaxDim (Flash and Pro) run the split-K
// path (mhc_split.h) at every token count: the projection spread over ~128-264 CTAs, then one CTA
// per token for the gates, Sinkhorn and the collapse; two launches chained by programmatic
// dependent launch, no cluster barrier. Forced (HcPath::kCluster), or at other widths,
// hc_pre/hc_post_pre/hc_head run one kernel: a thread-block cluster of CS = dim/256 (or dim/512)
// CTAs per tile of tokens, each CTA holding its 1/CS slice of all hc streams of the tile in
// shared memory (read from HBM once). The (2+hc)*hc-wide projection runs on tensor cores with
// fp32 `fn` split exactly into three BF16 parts (products exact, fp32 accumulation); the
// per-CTA partial projections and sums of squares are reduced across the cluster through
// distributed shared memory; Sinkhorn runs on a dedicated warp while the others collapse.
// That path serves dims that are a multiple of 256 with dim/256 <= 16 or dim/512 <= 16 (Flash
// 4096: 16 CTAs, Pro 7168: 14 CTAs; mhc_cfg::slice_dims). Every other width (e.g. 128, 384: small
// custom models) runs a per-token kernel (mhc_token.h: one CTA per token, fp64 projection) with
// the same contract against the CPU: hc_post's streams bit-exact, the rest the CPU's fp32
// operations in its order on a projection that differs only in summation order.
// Requirements (checked; an Error otherwise): hc == 4; dim a multiple of 8, at most
// mhc_cfg::kMaxDim (16384); sinkhorn_iters >= 1; eps finite and >= 0; non-null, 16-byte aligned
// pointers (base and scale: any alignment).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda {

// Which kernels run. kAuto: the split-K path (mhc_split.h) at the widths it takes
// (mhc_cfg::uses_split_kernel), else the cluster kernel (or the per-token kernel at the widths the
// cluster kernel does not take). kCluster / kSplit force one (benchmarks and
// tests compare them at one shape; kSplit takes any token count, and a width it does not take,
// not a multiple of 32 or above mhc_cfg::kSplitMaxDim, is an Error).
enum class HcPath { kAuto, kCluster, kSplit };

struct HcShape {
  int hc = 4;
  int dim = 0;
  int sinkhorn_iters = 20;
  float norm_eps = 1e-6f;  // of the RMS factor over hc*dim
  float hc_eps = 1e-6f;
};

// One HC unit's parameters (checkpoint layout, fp32 device arrays).
struct HcUnitParams {
  const float* fn = nullptr;     // [mix, hc*dim]: mix = (2+hc)*hc for pre, hc for the head
  const float* base = nullptr;   // [mix]
  const float* scale = nullptr;  // [3] (pre, post, comb) or [1] (head)
};

// Optional RMSNorm fused after the collapse: y = bf16(w * (y * rsqrt(mean(y^2) + eps))).
struct FusedNorm {
  const __nv_bfloat16* weight = nullptr;  // [dim]; null: no norm
  float eps = 1e-6f;
};

// Optional FP8 quantisation of y fused into the op (the FP8 GEMM that reads y needs no separate
// quantize_act_fp8 launch): codes and scales exactly as quantize_act_fp8 writes them for y
// (fp8_gemm.h; rows [tokens, fp8_scale_ld(tokens)) of the scales written as 0). Needs dim % 128
// == 0. The split-K path quantises in its finishing kernel; the other paths launch
// quantize_act_fp8 after the op (the same bytes).
struct FusedQuant {
  uint8_t* codes = nullptr;   // [tokens, dim] e4m3; null: no quantisation
  float* scales_t = nullptr;  // fp32 [dim / 128, ld_scales]
  int ld_scales = 0;          // >= tokens, a multiple of 4
};

struct HcPreParams {
  HcShape shape;
  int tokens = 0;
  const __nv_bfloat16* streams = nullptr;  // [tokens, hc, dim]
  HcUnitParams unit;
  FusedNorm norm;
  __nv_bfloat16* y = nullptr;  // [tokens, dim]
  float* post = nullptr;       // [tokens, hc]
  float* comb = nullptr;       // [tokens, hc, hc]
  FusedQuant quant;            // of y (optional)
  HcPath path = HcPath::kAuto;
};
void hc_pre(const HcPreParams& p, cudaStream_t stream);

struct HcPostParams {
  HcShape shape;
  int tokens = 0;
  const __nv_bfloat16* x = nullptr;    // [tokens, dim] sub-layer output
  const __nv_bfloat16* res = nullptr;  // [tokens, hc, dim] streams before the sub-layer
  const float* post = nullptr;         // [tokens, hc]
  const float* comb = nullptr;         // [tokens, hc, hc]
  __nv_bfloat16* out = nullptr;        // [tokens, hc, dim]; may be res (in place)
};
void hc_post(const HcPostParams& p, cudaStream_t stream);

// out = hc_post(post), then hc_pre(out) with the next unit. `out` may alias post.res and
// next_post/next_comb may alias post.post/post.comb (every read of a token precedes its writes).
struct HcPostPreParams {
  HcPostParams post;
  HcUnitParams unit;           // the next sub-layer's HC unit
  FusedNorm norm;              // the next sub-layer's norm
  __nv_bfloat16* y = nullptr;  // [tokens, dim]
  float* next_post = nullptr;  // [tokens, hc]
  float* next_comb = nullptr;  // [tokens, hc, hc]
  FusedQuant quant;            // of y (optional)
  HcPath path = HcPath::kAuto;
};
void hc_post_pre(const HcPostPreParams& p, cudaStream_t stream);

struct HcHeadParams {
  HcShape shape;
  int tokens = 0;
  const __nv_bfloat16* streams = nullptr;  // [tokens, hc, dim]
  HcUnitParams unit;                       // fn [hc, hc*dim], base [hc], scale [1]
  FusedNorm norm;                          // the final norm (optional)
  __nv_bfloat16* y = nullptr;              // [tokens, dim]
  HcPath path = HcPath::kAuto;
};
void hc_head(const HcHeadParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
