// Small element-wise kernels the CUDA model needs between the kernel families' launches, each
// with the CPU model's arithmetic (same operations, same order, round-to-nearest intrinsics).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::glue {

// The shared expert's activation (cpu::expert_forward without a routing weight):
// out[r, i] = bf16(silu(min(g, L)) * clamp(u, -L, L)) with g = gu[r, i], u = gu[r, inter + i]
// (no clamp when limit <= 0); silu(g) = g / (1 + exp(-g)).
void swiglu(const __nv_bfloat16* gu, int64_t ld_gu, int rows, int inter, float limit,
            __nv_bfloat16* out, cudaStream_t stream);

// swiglu fused with the FP8 activation quantisation of its output, for the shared expert's w2:
// out as swiglu's (bit-identical), codes/scales_t bytes identical to cuda::quantize_act_fp8 of
// out (e4m3 [rows, inter] packed; fp32 [inter/128, ld_scales], pad rows up to 4 as 0).
struct SwigluFp8Params {
  const __nv_bfloat16* gu = nullptr;  // [rows, ld_gu]: g in [0, inter), u in [inter, 2 inter)
  int64_t ld_gu = 0;                  // >= 2 inter, multiple of 8
  int rows = 0;
  int inter = 0;  // multiple of 128
  float limit = 0.0f;
  __nv_bfloat16* out = nullptr;  // [rows, inter]
  uint8_t* codes = nullptr;
  float* scales_t = nullptr;
  int ld_scales = 0;  // multiple of 4, >= rows
  bool pdl = false;   // programmatic dependent launch (graph-capturable)
};
void swiglu_fp8(const SwigluFp8Params& p, cudaStream_t stream);

// MTP input: x[t, k, :] = bf16(e[t, :] + h[t, k, :]) for the hc streams k.
void mtp_combine(const __nv_bfloat16* e, const __nv_bfloat16* h, int tokens, int hc, int dim,
                 __nv_bfloat16* x, cudaStream_t stream);

// dst[i, :] = src[rows[i], :] for rows of `row_elems` BF16 values (multiple of 8).
void gather_rows(const __nv_bfloat16* src, int64_t row_elems, const int32_t* rows, int n,
                 __nv_bfloat16* dst, cudaStream_t stream);

// dst[dst_rows ? dst_rows[i] : i, :] = src[i] >= 0 ? a[src[i], :] : b[-src[i] - 1, :] for rows of
// `row_elems` BF16 values (multiple of 8): speculative decoding's MTP inputs, gathered from the
// step's streams (a) and the sequences' MTP states (b), and the states' update.
void move_rows(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t row_elems,
               const int32_t* src, const int32_t* dst_rows, int n, __nv_bfloat16* dst,
               cudaStream_t stream);

// One byte range to copy between device addresses.
struct CopySegment {
  const uint8_t* src;
  uint8_t* dst;
  int64_t bytes;
};
// Every segment's bytes (segments: device array), one launch: speculative decoding's saves
// and restores of the cache stores a step overwrites.
void copy_segments(const CopySegment* segments, int n, cudaStream_t stream);

}  // namespace dsv4::glue
