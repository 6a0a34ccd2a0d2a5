// Internal: the two wo_a GEMM implementations behind attn_output_wo_a (attn_output.cu picks).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda {

struct WoAArgs {
  const __nv_bfloat16* o = nullptr;  // [T, ldo]; group g's activations at column g * in_g
  const float2* cos_sin = nullptr;   // [T, 32]; null: no RoPE (weight-stream kernel)
  int num_tokens = 0;
  int64_t ldo = 0;  // num_heads * 512
  int in_g = 0;     // K = heads_per_group * 512
  int o_groups = 0, o_lora = 0;
  const uint8_t* w = nullptr;                   // [o_groups * o_lora, in_g] e4m3
  const uint8_t* w_scale = nullptr;             // [o_groups * o_lora / 128, in_g / 128] UE8M0
  const __nv_bfloat16* w_scale_rows = nullptr;  // [o_groups, in_g / 128, o_lora]
  __nv_bfloat16* z = nullptr;                   // [T, ldz]
  int64_t ldz = 0;                              // o_groups * o_lora
  bool pdl = false;  // weight stream: programmatic dependent launch (WoAParams::pdl)
};

// M <= kWoAWeightStreamMaxM; applies the inverse RoPE itself (o is not written).
void wo_a_weight_stream(const WoAArgs& a, cudaStream_t stream);
// Any M; o must already hold the de-rotated values. Throws when built without CUTLASS.
void wo_a_tensor_core(const WoAArgs& a, cudaStream_t stream);

}  // namespace dsv4::cuda
