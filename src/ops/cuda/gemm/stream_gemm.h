// Host entry points of the weight-streaming GEMM (stream_gemm.cuh), shared by the FP8 GEMM
// (fp8_gemm.h) and the head's logits (head/logits.h). Internal to src/ops/cuda.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/gemm/fp8_gemm_heuristic.h"

namespace dsv4::cuda::detail {

// A further weight of a grouped launch: same k and activations as the first, its own output.
struct StreamGemmWeight {
  const void* w = nullptr;  // [n, k] row-major
  int n = 0;
  const float* w_scales_t = nullptr;  // fp8: [k/128, ceil(n/128)] fp32
  void* out = nullptr;                // [m, ldo]
  int64_t ldo = 0;
};

struct StreamGemmLaunch {
  const void* w = nullptr;  // [n, k] row-major: e4m3 (fp8) or BF16
  int n = 0;
  int k = 0;
  const void* a = nullptr;  // [m, k] e4m3 (packed rows) or BF16 (row stride lda elements)
  int64_t lda = 0;
  int m = 0;                          // 1..kStreamMaxM (blocks of 64 above 64)
  const float* a_scales_t = nullptr;  // fp8: [k/128, a_ld] fp32
  int a_ld = 0;
  const float* w_scales_t = nullptr;  // fp8: [k/128, ceil(n/128)] fp32
  void* out = nullptr;                // [m, ldo]: BF16 (fp8) or fp32 (BF16 operands)
  int64_t ldo = 0;
  // Grouped launch: `more` weights (0..kStreamMaxGroups-1) after the one above, in one grid.
  int more = 0;
  StreamGemmWeight more_w[3];
  bool pdl = false;
  int splits = 0;  // 0: plan_stream's choice (tests force other values)
};

// Validated by the callers; these check only what the kernel itself needs.
void stream_gemm_fp8(const StreamGemmLaunch& p, cudaStream_t stream);
void stream_gemm_bf16(const StreamGemmLaunch& p, cudaStream_t stream);

// What the current device holds of the FP8 streaming kernel, as its plans use it (the least
// over the token widths, so that a weight's K split is the same at every m).
StreamResidency stream_residency_fp8();
// The largest K split (cluster size) the FP8 streaming kernel plans with on the current device,
// the same for every m (16 where the device places non-portable 16-CTA clusters, else 8).
int stream_max_splits_fp8(int m);

}  // namespace dsv4::cuda::detail
