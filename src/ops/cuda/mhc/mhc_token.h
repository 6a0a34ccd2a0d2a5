// The per-token mHC kernel (mhc_token.cu): hc_pre / hc_head for the widths the cluster kernels
// (mhc.cu) do not take (mhc_cfg::slice_dims(dim) == 0: dims that are not a multiple of 256,
// e.g. 128 or 384, and multiples of 256 beyond the 16-CTA cluster limit), any multiple of 8 up to
// mhc_cfg::kMaxDim. Internal to the mhc family: mhc.cu validates the parameters and picks the
// path; hc_post (elementwise, any width) and hc_post_pre (hc_post, then hc_pre) reuse mhc.cu's
// streaming hc_post kernel.
//
// One CTA per token. Its threads split the 4*dim values of the token's streams in chunks of 8;
// each thread accumulates the sum of squares and the mix-wide projection in fp64 (BF16 x fp32
// products are exact in fp64, so only the additions round, at 2^-53: the CPU reference also sums
// in fp64), then a fixed-order reduction (warp butterflies, then warps in index order) gives one
// value per mix. The fp32 steps after it (RMS factor, sigmoid gates, Sinkhorn, the collapse and
// the fused RMSNorm) are the CPU's operations in its order (mhc_math.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace dsv4::cuda::mhc_token {

struct Params {
  bool head = false;  // hc_head (4 mixes, no post/comb) instead of hc_pre (24 mixes)
  int tokens = 0;
  int dim = 0;
  int iters = 20;
  float norm_eps = 1e-6f, hc_eps = 1e-6f;
  const __nv_bfloat16* streams = nullptr;  // [tokens, 4, dim]
  const float* fn = nullptr;               // [mix, 4 * dim]
  const float* base = nullptr;             // [mix]
  const float* scale = nullptr;            // [3] (pre) or [1] (head)
  const __nv_bfloat16* norm_w = nullptr;   // [dim] fused RMSNorm weight, or null
  float nrm_eps = 1e-6f;
  __nv_bfloat16* y = nullptr;  // [tokens, dim]
  float* post = nullptr;       // [tokens, 4] (pre only)
  float* comb = nullptr;       // [tokens, 4, 4] (pre only)
};

// Launches the kernel on `stream`; the caller has validated p (mhc.cu).
void launch(const Params& p, cudaStream_t stream);

}  // namespace dsv4::cuda::mhc_token
