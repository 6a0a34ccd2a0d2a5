// y = x W^T with the reference's numerics for each weight kind. One output row depends only
// on its input row, so results never depend on how many rows are computed together.
#pragma once

#include <vector>

namespace dsv4::cpu {

enum class LinearKind {
  kFp8,   // FP8 block GEMM: x -> e4m3 per (row, 128) with UE8M0 scale; partial sums per
          // 128-wide K block, accumulated in fp32; BF16 out.
  kFp4,   // FP4 expert GEMM: same activation quantisation; partial sums per 32-wide K step.
  kBf16,  // BF16 x BF16, fp32 accumulation, BF16 out.
  kF32,   // fp32 x fp32 -> fp32.
};

struct Linear {
  LinearKind kind = LinearKind::kBf16;
  int out = 0;
  int in = 0;
  // Dequantised weights, exact, transposed to [in, out] so a K step updates a contiguous row
  // of accumulators (each output's sum stays in order).
  std::vector<float> wt;

  // Builds from row-major [out, in] values.
  static Linear from_rows(LinearKind kind, int out, int in, const std::vector<float>& w);
};

// x: [m, in] (BF16 values for kFp8/kFp4/kBf16), y: [m, out].
void linear(const Linear& w, const float* x, int m, float* y);

// The partial-sum width along K for a kind (K itself for unquantised kinds).
int linear_kblock(const Linear& w);

}  // namespace dsv4::cpu
