#include "backends/cuda/blas.h"

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4 {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

void check(cublasStatus_t st, const char* what) {
  DSV4_CHECK(st == CUBLAS_STATUS_SUCCESS, what, " failed (cuBLAS status ", int(st), ")");
}

}  // namespace

CudaBlas::CudaBlas() {
  check(cublasCreate(&h_), "cublasCreate");
  check(cublasSetMathMode(h_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  workspace_ = cuda::DeviceBuffer<uint8_t>(kWorkspaceBytes);
  check(cublasSetWorkspace(h_, workspace_.data(), workspace_.size()), "cublasSetWorkspace");
}

CudaBlas::~CudaBlas() {
  if (h_) cublasDestroy(h_);
}

void CudaBlas::linear(const __nv_bfloat16* x, int64_t ldx, int m, const __nv_bfloat16* w, int n,
                      int k, void* y, int64_t ldy, bool f32_out, cudaStream_t stream) {
  DSV4_CHECK(m >= 0 && n > 0 && k > 0 && ldx >= k && ldy >= n, "cuBLAS linear: bad shape m=", m,
             " n=", n, " k=", k);
  if (m == 0) return;
  check(cublasSetStream(h_, stream), "cublasSetStream");
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: Y^T [n, m] = W [k, n]^T . X^T [k, m].
  check(cublasGemmEx(h_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w, CUDA_R_16BF, k, x,
                     CUDA_R_16BF, int(ldx), &beta, y, f32_out ? CUDA_R_32F : CUDA_R_16BF, int(ldy),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (BF16 linear)");
}

}  // namespace dsv4
