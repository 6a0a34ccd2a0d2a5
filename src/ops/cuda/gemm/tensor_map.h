// Host-side construction of TMA descriptors (CUtensorMap) for 2-D row-major tensors. The driver
// entry point is fetched through the runtime once, so nothing links against libcuda.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace dsv4::cuda {

enum class TmaSwizzle { kNone, k128B };

// A [rows, cols] row-major tensor of `dtype` elements (row stride `row_stride_bytes`, a multiple
// of 16, base 16-byte aligned), read in boxes of [box_rows, box_cols]; elements outside
// [rows, cols] read as zero. Throws dsv4::Error on any rejected parameter.
CUtensorMap make_tma_2d(const void* base, CUtensorMapDataType dtype, int elem_bytes, int64_t rows,
                        int64_t cols, int64_t row_stride_bytes, int box_rows, int box_cols,
                        TmaSwizzle swizzle);

}  // namespace dsv4::cuda
