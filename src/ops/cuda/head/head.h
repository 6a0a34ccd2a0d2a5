// The vocabulary-sized ops: the embedding gather (with the repeat into hc streams) and the
// head's logits, fp32 logits = fp32(x) . fp32(W)^T for BF16 x and BF16 W (spec §3), as
// cpu::linear(LinearKind::kF32) on the same values: BF16 products are exact in fp32 and are
// accumulated in fp32 on the tensor cores.
//   m <= 64: the weight-streaming kernel (gemm/stream_gemm.cuh, BF16 wgmma), the head being a
//            1-2 GB weight stream at decode;
//   m > 64 : cuBLAS (cublasGemmEx BF16 x BF16 -> fp32, fp32 compute), given a handle.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda {

struct EmbedParams {
  const int32_t* tokens = nullptr;  // [n] device
  int n = 0;
  const __nv_bfloat16* table = nullptr;  // [vocab, dim]
  int vocab = 0;
  int dim = 0;                   // multiple of 8
  int repeat = 1;                // copies per token: hc (streams) or 1
  __nv_bfloat16* out = nullptr;  // [n, repeat, dim]
  int* bad_tokens = nullptr;     // optional device counter of ids outside [0, vocab);
                                 // their rows are written as zeros
};
void embed(const EmbedParams& p, cudaStream_t stream);

struct LogitsParams {
  const __nv_bfloat16* x = nullptr;  // [m, dim], row stride ldx (0: dim)
  int64_t ldx = 0;
  int m = 0;
  const __nv_bfloat16* w = nullptr;  // [vocab, dim] (head.weight)
  int vocab = 0;
  int dim = 0;              // multiple of 64
  float* logits = nullptr;  // [m, ldl] (0: vocab)
  int64_t ldl = 0;
  cublasHandle_t cublas = nullptr;  // needed when m > 64 (its stream is set to `stream`)
};
void head_logits(const LogitsParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
