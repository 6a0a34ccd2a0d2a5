#include "ops/cuda/gemm/tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <mutex>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4::cuda {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    DSV4_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                     cudaEnableDefault, &q));
    DSV4_CHECK(q == cudaDriverEntryPointSuccess && p != nullptr,
               "cuTensorMapEncodeTiled is not available from the driver");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  return fn;
}

}  // namespace

CUtensorMap make_tma_2d(const void* base, CUtensorMapDataType dtype, int elem_bytes, int64_t rows,
                        int64_t cols, int64_t row_stride_bytes, int box_rows, int box_cols,
                        TmaSwizzle swizzle) {
  DSV4_CHECK(base != nullptr && reinterpret_cast<uintptr_t>(base) % 16 == 0,
             "TMA: base address must be 16-byte aligned");
  DSV4_CHECK(rows > 0 && cols > 0, "TMA: empty tensor [", rows, ", ", cols, "]");
  DSV4_CHECK(row_stride_bytes % 16 == 0, "TMA: row stride ", row_stride_bytes,
             " bytes is not a multiple of 16");
  DSV4_CHECK(box_rows >= 1 && box_rows <= 256 && box_cols >= 1 && box_cols <= 256, "TMA: box [",
             box_rows, ", ", box_cols, "] out of range");
  DSV4_CHECK((int64_t(box_cols) * elem_bytes) % 16 == 0, "TMA: box row of ", box_cols * elem_bytes,
             " bytes is not a multiple of 16");
  if (swizzle == TmaSwizzle::k128B)
    DSV4_CHECK(box_cols * elem_bytes <= 128, "TMA: 128B swizzle needs box rows <= 128 bytes");
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(row_stride_bytes)};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_fn()(
      &map, dtype, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE,
      swizzle == TmaSwizzle::k128B ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DSV4_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (", int(r), ") for [", rows, ", ",
             cols, "] box [", box_rows, ", ", box_cols, "]");
  return map;
}

}  // namespace dsv4::cuda
