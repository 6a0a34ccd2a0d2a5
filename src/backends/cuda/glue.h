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
