// BF16 linears at decode batch sizes (m <= kBf16StreamMaxM rows): y = x W^T with BF16 x and W,
// fp32 sums, fp32 or BF16 out, weights streamed once on CUDA cores, up to kBf16StreamMaxOuts
// weights that read the same x in one launch (the compressors' stacked [wkv; wgate] projections
// and the indexer's weights_proj: one launch where cuBLAS took two GEMMs and two split-K
// reductions). Each CTA prefetches its weight rows into L2 before it waits for the kernel
// before it (programmatic dependent launch), so the stream starts under that kernel's tail.
//
// Numerics: the products of BF16 values are exact in fp32; each lane sums its K chunks (8
// elements, chunks lane, lane + 32, ...) in order with fp32 FMAs, then the 32 lanes are added by
// butterfly: at most ceil(k / 256) * 8 + 5 fp32 roundings on any path, each within 2^-24 of its
// partial, in a fixed order (run-to-run identical). So |y - exact| <= that count * 2^-24 *
// sum |w x| (bf16_stream_linear_test checks it, and the distance to cpu::linear); verify mode
// judges these linears by the BF16 tensor-core model (cpu::kBf16Mma) as it did the cuBLAS GEMMs.
//
// Requirements (checked; an Error otherwise): 0 <= m <= kBf16StreamMaxM; k > 0 a multiple of 8;
// ldx >= k and a multiple of 8; x and every weight 16-byte aligned; n > 0, ldy >= n; count in
// [1, kBf16StreamMaxOuts]. m == 0 is a no-op.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda {

constexpr int kBf16StreamMaxM = 8;
constexpr int kBf16StreamMaxOuts = 2;

struct Bf16StreamOut {
  const __nv_bfloat16* w = nullptr;  // [n, k] row-major (the checkpoint layout)
  int n = 0;
  void* y = nullptr;  // [m, ldy]: fp32 when f32, else BF16 (round to nearest even)
  int64_t ldy = 0;
  bool f32 = false;
};

struct Bf16StreamLinearParams {
  const __nv_bfloat16* x = nullptr;  // [m, k], row stride ldx (0: k)
  int64_t ldx = 0;
  int m = 0;
  int k = 0;
  Bf16StreamOut out[kBf16StreamMaxOuts];
  int count = 1;
  // Programmatic dependent launch: x is read only after griddepcontrol.wait (graph-capturable).
  bool pdl = false;
};
void bf16_stream_linear(const Bf16StreamLinearParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
