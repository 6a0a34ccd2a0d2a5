#include "ops/cuda/head/head.h"

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/gemm/fp8_gemm_config.h"
#include "ops/cuda/gemm/stream_gemm.h"

namespace dsv4::cuda {
namespace {

__global__ void embed_kernel(EmbedParams p) {
  const int per_row = p.dim / 8;
  const int64_t total = int64_t(p.n) * p.repeat * per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / (int64_t(p.repeat) * per_row);
    const int rest = int(i % (int64_t(p.repeat) * per_row));
    const int k = rest / per_row, c = rest % per_row;
    const int id = __ldg(p.tokens + t);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (id >= 0 && id < p.vocab)
      v = __ldg(reinterpret_cast<const uint4*>(p.table + int64_t(id) * p.dim) + c);
    else if (k == 0 && c == 0 && p.bad_tokens)
      atomicAdd(p.bad_tokens, 1);
    reinterpret_cast<uint4*>(p.out + (t * p.repeat + k) * p.dim)[c] = v;
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

void embed(const EmbedParams& p, cudaStream_t stream) {
  DSV4_CHECK(p.n >= 0 && p.vocab > 0 && p.dim > 0 && p.dim % 8 == 0 && p.repeat >= 1,
             "embed: n=", p.n, " vocab=", p.vocab, " dim=", p.dim,
             " (multiple of 8) repeat=", p.repeat);
  if (p.n == 0) return;
  DSV4_CHECK(p.tokens && p.table && p.out, "embed: null pointer");
  DSV4_CHECK(aligned16(p.table) && aligned16(p.out), "embed: table/out must be 16-byte aligned");
  const int64_t total = int64_t(p.n) * p.repeat * (p.dim / 8);
  const int threads = 256;
  const int grid = int(std::min<int64_t>((total + threads - 1) / threads, 132 * 32));
  embed_kernel<<<grid, threads, 0, stream>>>(p);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void head_logits(const LogitsParams& p, cudaStream_t stream) {
  DSV4_CHECK(p.m >= 0 && p.vocab > 0 && p.dim > 0 && p.dim % 64 == 0, "head_logits: m=", p.m,
             " vocab=", p.vocab, " dim=", p.dim, " (dim must be a multiple of 64)");
  if (p.m == 0) return;
  const int64_t ldx = p.ldx ? p.ldx : p.dim, ldl = p.ldl ? p.ldl : p.vocab;
  DSV4_CHECK(ldx >= p.dim && ldx % 8 == 0 && ldl >= p.vocab, "head_logits: strides ldx=", ldx,
             " ldl=", ldl);
  DSV4_CHECK(p.x && p.w && p.logits, "head_logits: null pointer");
  DSV4_CHECK(aligned16(p.x) && aligned16(p.w), "head_logits: x and w must be 16-byte aligned");
  if (p.m <= gemm_cfg::kStreamMaxTokens) {
    detail::StreamGemmLaunch s;
    s.w = p.w;
    s.n = p.vocab;
    s.k = p.dim;
    s.a = p.x;
    s.lda = ldx;
    s.m = p.m;
    s.out = p.logits;
    s.ldo = ldl;
    detail::stream_gemm_bf16(s, stream);
    return;
  }
  DSV4_CHECK(p.cublas != nullptr, "head_logits: m = ", p.m, " > ", gemm_cfg::kStreamMaxTokens,
             " runs on cuBLAS and needs a cublasHandle_t");
  // Column-major view: logits^T [vocab, m] = W [vocab, dim] . x^T [dim, m].
  const float one = 1.0f, zero = 0.0f;
  DSV4_CHECK(cublasSetStream(p.cublas, stream) == CUBLAS_STATUS_SUCCESS,
             "head_logits: cublasSetStream failed");
  const cublasStatus_t st =
      cublasGemmEx(p.cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.vocab, p.m, p.dim, &one, p.w, CUDA_R_16BF,
                   p.dim, p.x, CUDA_R_16BF, int(ldx), &zero, p.logits, CUDA_R_32F, int(ldl),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  DSV4_CHECK(st == CUBLAS_STATUS_SUCCESS, "head_logits: cublasGemmEx failed (", int(st), ")");
}

}  // namespace dsv4::cuda
