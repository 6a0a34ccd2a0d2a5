// The kernels of the parallel MoE's decode exchange (parallel_moe.h): an all-gather of every
// rank's routed rows into fixed-capacity slabs whose row counts travel with them on the device,
// the owner's selection of its experts' pairs, and the combine of the owners' partial sums.
// Sizes are the step's capacities, never the row counts, so a decode step that uses them is
// capturable into a CUDA graph.
//
// A slab (one per rank, `cap` rows): the row count (int32, 16 bytes), sel [cap, K] int32,
// wt [cap, K] fp32, xq [cap, dim] BF16 (the quantised x rows), each part 16-byte aligned, the
// whole a multiple of 256 bytes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dsv4::exchange {

size_t slab_bytes(int cap, int top_k, int dim);

// slab = m routed rows (m <= cap; m = 0: the count alone).
void pack(const int32_t* sel, const float* wt, const __nv_bfloat16* xq, int m, int top_k, int dim,
          int cap, void* slab, cudaStream_t stream);

// From `ranks` slabs back to back: row r = s * cap + i of the owner's batch is slab s's row i,
// with out_k = min(top_k, count) slots: sel[r, j] = the j-th distinct expert of the owner's
// [lo, lo + count) among the row's slots (slot order; a repeated one counts once, as the MoE
// grouping counts it) minus lo, wt[r, j] its first slot's weight; -1 and 0 in the slots left
// over and in every slot of rows past slab s's row count (no pairs: the grouping skips them);
// xq[r] the row's x (rows past the count are left as they are: nothing reads them).
void select(const void* slabs, int ranks, int cap, int top_k, int dim, int lo, int count, int out_k,
            int32_t* sel, float* wt, __nv_bfloat16* xq, cudaStream_t stream);

// out[r, :] (fp32) = the sum over row r's pairs (pair_pos >= 0) in ascending expert index of
// ye[pair_pos, :], each addition rounded once; 0 for a row without pairs. rows x top_k slots.
void partial_sums(const int32_t* sel, const int32_t* pair_pos, int rows, int top_k,
                  const __nv_bfloat16* ye, int dim, float* out, cudaStream_t stream);

// y[i, :] = bf16((parts[0][i] + parts[1][i] + ... ) + shared[i]) for i < m, the owners' partial
// sums (fp32, owner o's at parts + o * part_stride rows) added in owner order, then the shared
// expert's output (null: 0), rounded once.
void finish(const float* parts, int owners, int64_t part_stride, int m, const __nv_bfloat16* shared,
            int dim, __nv_bfloat16* y, cudaStream_t stream);

}  // namespace dsv4::exchange
