// Host entry of the prefill (tensor-core) FP8 GEMM, CUTLASS-based (fp8_gemm_prefill.cu).
// Internal to src/ops/cuda; fp8_gemm.h validates the arguments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dsv4::cuda::detail {

// Tile scheduler of the CUTLASS kernel: persistent data-parallel tiles, or stream-K (K split
// across CTAs with a deterministic, turnstile-ordered fixup) for grids under one wave.
enum class PrefillScheduler { kAuto, kPersistent, kStreamK };

struct PrefillArgs {
  const uint8_t* a = nullptr;         // [m, k] e4m3
  const float* a_scales_t = nullptr;  // [k/128, a_ld]; rows [m, round_up(m, 4)) are read too
  int a_ld = 0;                       // multiple of 4, >= m (fp8_scale_ld(m))
  const uint8_t* w = nullptr;         // [n, k] e4m3
  const float* w_scales_t = nullptr;  // [k/128, ceil(n/128)]
  __nv_bfloat16* y = nullptr;         // [m, ldy]
  int64_t ldy = 0;
  int m = 0, n = 0, k = 0;
  bool pdl = false;
  PrefillScheduler scheduler = PrefillScheduler::kAuto;
  // Stream-K scheduler only: > 1 splits each output tile's K evenly over that many CTAs (CUTLASS's
  // split-K decomposition, the same deterministic fixup) instead of stream-K's even share of
  // all K iterations; 0 = what the scheduler choice implies (kAuto: prefill_split_k where it
  // takes stream-K, kStreamK: stream-K's own decomposition).
  int splits = 0;
};

size_t prefill_workspace_bytes(const PrefillArgs& p);
// CUTLASS's own argument checks (GemmUniversalAdapter::can_implement: TMA alignment of A, B, D
// and the activation scales, scheduler arguments) on the arguments prefill_gemm would pass, for
// p.scheduler (kAuto: both schedulers). Host only: queries and touches no device, so tests can
// prove every shape is accepted without a GPU. Throws dsv4::Error on a bad scale stride.
bool prefill_can_implement(const PrefillArgs& p);
void prefill_gemm(const PrefillArgs& p, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream);

}  // namespace dsv4::cuda::detail
