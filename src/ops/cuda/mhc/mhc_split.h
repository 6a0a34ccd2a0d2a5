// The split-K path of mHC (mhc_split.cu): hc_pre / hc_post_pre / hc_head at widths a multiple of
// 32 up to kSplitMaxDim, any token count (mhc_cfg::uses_split_kernel). Internal to the mhc family:
// mhc.cu validates the parameters and picks the path.
//
// Two kernels (three at prefill sizes), chained by programmatic dependent launch, no cluster and
// no grid-wide barrier:
//  1. projection, grid (splits, token tiles): CTA s owns a contiguous range of d-chunks (32 dims of
//     all 4 streams; warp j takes stream j) for a tile of 16/32/64 tokens; for hc_post_pre it first
//     computes the new streams of its range (hc_post, the CPU's operations) and writes them. The
//     partial projection runs on tensor cores with fp32 `fn` split exactly into three BF16 parts
//     (exact products, fp32 accumulation over the CTA's range), the 4 warps' partials are added in
//     stream order, and the CTA writes its partial mixes (fp32) and sum of squares (fp64) to a
//     workspace. fn, the only large read at decode (1.5 MB Flash, 2.75 MB Pro), is spread over
//     ~128-224 CTAs and fetched before the kernel waits on its predecessor.
//  2. finish, one CTA per token: sums the splits' partials in a fixed order (10 ranges of splits,
//     each in split order, in fp64; then the ranges in order), so the result does not depend on
//     scheduling; computes the RMS factor and the gates (warp 0), runs Sinkhorn on 16 lanes of
//     warp 0 while warps 1-7 collapse y = bf16(sum_j pre_j h_j) (and the fused RMSNorm, and the
//     FP8 quantisation of y: a half-warp holds one 128-element block).
//  3. beyond kSplitEarlyLoadMaxTokens tokens (the staged finish), Sinkhorn runs apart, after the
//     finish, two tokens a warp (the finish leaves the comb logits in `comb`): 20 dependent
//     iterations no longer keep a finishing CTA resident once its collapse is done.
// Every fp32 step after the projection is the CPU's operation in its order (mhc_math.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda::mhc_split {

enum class Kind { kPre, kPostPre, kHead };

struct Params {
  Kind kind = Kind::kPre;
  int tokens = 0;
  int dim = 0;
  int iters = 20;
  float norm_eps = 1e-6f, hc_eps = 1e-6f;
  const __nv_bfloat16* streams = nullptr;  // kPre / kHead: [tokens, 4, dim]
  const __nv_bfloat16* x_prev = nullptr;   // kPostPre: sub-layer output [tokens, dim]
  const __nv_bfloat16* res = nullptr;      // kPostPre: streams before it [tokens, 4, dim]
  const float* post_prev = nullptr;        // kPostPre: [tokens, 4]
  const float* comb_prev = nullptr;        // kPostPre: [tokens, 4, 4]
  __nv_bfloat16* streams_out = nullptr;    // kPostPre: new streams (may be res)
  const float* fn = nullptr;               // [mix, 4 * dim]
  const float* base = nullptr;             // [mix]
  const float* scale = nullptr;            // [3] (pre) or [1] (head)
  const __nv_bfloat16* norm_w = nullptr;   // [dim] fused RMSNorm weight, or null
  float nrm_eps = 1e-6f;
  __nv_bfloat16* y = nullptr;  // [tokens, dim]
  float* post = nullptr;       // [tokens, 4] (not kHead); may be post_prev
  float* comb = nullptr;       // [tokens, 4, 4] (not kHead); may be comb_prev
  // Optional (not kHead; dim % 128 == 0): y's FP8 codes and transposed scales, as
  // quantize_act_fp8 writes them (mhc.h FusedQuant), by the finishing kernel.
  uint8_t* q_codes = nullptr;
  float* q_scales_t = nullptr;
  int q_ld_scales = 0;
};

// Grid of the projection kernel for a shape (host arithmetic, no CUDA call): token rows per
// tile, tiles, d-chunks per split, splits.
// staged: the projection stages the streams through shared memory (mhc_config.h,
// kSplitStagedMinTokens; kPre and kHead only).
struct Geometry {
  int rows = 0, tiles = 0, chunks_per_split = 0, splits = 0;
  bool staged = false;
};
Geometry geometry(int dim, int tokens, int sm_count, bool can_stage = true);

// Partials (token, split pairs) the workspace reserves: 64 (2 sms + 8), at least tokens x splits
// of every shape of up to that many tokens (so every decode step and prefill chunk of up to ~17K
// tokens on an H200, captured or not, finds its workspace in place): splits <= the CTAs per
// tile, max(1, 2 sms / tiles), so tokens x splits <= max(rows x 2 sms, tokens), rows <= 64.
size_t reserved_partials(int sm_count);

// Launches both kernels on `stream`; the caller has validated p (mhc.cu).
void launch(const Params& p, cudaStream_t stream);

// Allocates `stream`'s partials workspace (sized for every decode shape) unless it exists or a
// graph capture is under way on `stream`; mhc.cu calls it on every path at the widths the split
// path takes, so decode graphs captured after any eager mHC op never need to allocate.
void reserve_workspace(cudaStream_t stream);

}  // namespace dsv4::cuda::mhc_split
