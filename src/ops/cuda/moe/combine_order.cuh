// The combine's summation order, shared by moe_route.cu's combine and the expert-parallel
// exchange's partial sums (backends/cuda/moe_exchange.cu), so the two are identical by
// construction: a row's slots are taken in ascending expert index (stable in slot order; a
// repeated expert's later slots have position -1 and are skipped), and each column is the
// fp32 sum, in that order, of the BF16 expert outputs (= cpu::moe_combine).
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

namespace dsv4::cuda::moe {

// Slot `i` of a row (sel, pair_pos: the row's top_k entries) stores its position in the
// sorted expert outputs at its rank in ascending expert index: order[rank] = pair_pos[i].
// Called by the threads i < top_k; `order` holds top_k ints.
__device__ __forceinline__ void combine_order_slot(const int32_t* sel, const int32_t* pair_pos,
                                                   int top_k, int i, int* order) {
  const int e = sel[i];
  int rank = 0;
  for (int j = 0; j < top_k; ++j) {
    const int f = sel[j];
    rank += f < e || (f == e && j < i);
  }
  order[rank] = pair_pos[i];
}

// acc[0..7] = fp32 sum over the ordered positions (skipping -1) of the expert outputs
// ye[pos][c .. c + 8), added in order starting from +0.
__device__ __forceinline__ void combine_sum8(const int* order, int top_k, const __nv_bfloat16* ye,
                                             size_t dim, int c, float acc[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  for (int i = 0; i < top_k; ++i) {
    const int pos = order[i];
    if (pos < 0) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(ye + size_t(pos) * dim + c);
    const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[2 * j] = __fadd_rn(acc[2 * j], __uint_as_float((h[j] & 0xffffu) << 16));
      acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __uint_as_float(h[j] & 0xffff0000u));
    }
  }
}

}  // namespace dsv4::cuda::moe
