// The checkpoint tensors an op consumes, as views into the mapped files: FP8 linears, FP4
// routed experts in either checkpoint format, and one layer's MoE. The model's weight
// inventory (model/weights.h) binds them; the CPU and CUDA ops build their working copies
// from them.
#pragma once

#include <vector>

#include "io/tensor_view.h"

namespace dsv4 {

// How a routed expert's FP4 weights are scaled: DeepSeek's native MXFP4 (UE8M0 per 32) or
// NVIDIA ModelOpt's NVFP4 (E4M3 per 16 times an fp32 global scale).
enum class ExpertFormat { kMxfp4, kNvfp4 };

inline const char* expert_format_name(ExpertFormat f) {
  return f == ExpertFormat::kNvfp4 ? "NVFP4" : "MXFP4";
}

// FP8 e4m3 [out, in] with UE8M0 scales per 128x128 block.
struct Fp8Ref {
  const TensorView* weight = nullptr;
  const TensorView* scale = nullptr;
};

// Routed-expert projection in FP4 e2m1, packed two per byte along `in`.
struct Fp4Ref {
  ExpertFormat format = ExpertFormat::kMxfp4;
  const TensorView* weight = nullptr;       // I8/U8 [out, in/2]
  const TensorView* scale = nullptr;        // MXFP4: E8M0 [out, in/32]; NVFP4: E4M3 [out, in/16]
  const TensorView* scale_2 = nullptr;      // NVFP4: F32 [] global scale
  const TensorView* input_scale = nullptr;  // NVFP4: F32 [] (FP4-activation kernels only)
};

struct ExpertRef {
  Fp4Ref w1, w2, w3;
};

struct MoeRef {
  const TensorView* gate = nullptr;     // BF16 [experts, dim]
  const TensorView* bias = nullptr;     // F32 [experts] (score-routed blocks)
  const TensorView* tid2eid = nullptr;  // I64/I32 [vocab, top-k] (hash-routed blocks)
  std::vector<ExpertRef> experts;
  Fp8Ref shared_w1, shared_w2, shared_w3;
};

}  // namespace dsv4
