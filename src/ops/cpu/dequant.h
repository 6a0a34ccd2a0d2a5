// Exact dequantisation of checkpoint tensors to float, for the CPU backend.
#pragma once

#include <vector>

#include "io/tensor_view.h"
#include "ops/common/weight_refs.h"

namespace dsv4::cpu {

// BF16 or F32 tensor -> floats.
std::vector<float> to_float(const TensorView& t);
// FP8 e4m3 [out, in] x UE8M0 [ceil(out/128), ceil(in/128)].
std::vector<float> dequant_fp8(const Fp8Ref& r);
// MXFP4: e2m1 x UE8M0 per 32; NVFP4: (e2m1 x E4M3 per 16) x fp32 global scale.
std::vector<float> dequant_fp4(const Fp4Ref& r);

}  // namespace dsv4::cpu
