// The attention output path on the GPU (CpuModel::attention after sparse attention): inverse
// RoPE of each head's last 64 dims at the query's position (cpu::rope_apply, inverse), then the
// grouped wo_a exactly as the reference computes it: BF16 activations, the FP8 e4m3 weight
// dequantised exactly to BF16 (x its 128x128 UE8M0 block scale), fp32 accumulation, BF16 out
// (cpu::linear kBf16 on the group's rows). Group g multiplies the heads g*H/G .. (g+1)*H/G-1
// (concatenated, in_g = H/G*512 wide) by rows g*o_lora .. (g+1)*o_lora-1 of wo_a
// [o_groups*o_lora, in_g]; z = [T, o_groups*o_lora] (group-major, as the CPU's z).
//
// Two kernels, one contract:
//  - kWeightStream (M <= 64 tokens): weight-streaming mma.sync kernel reading the FP8 weight
//    once (half the bytes of BF16), the inverse RoPE fused into its activation load;
//  - kTensorCore (any M, meant for prefill): a CUTLASS sm90 warp-specialised wgmma mixed-input
//    GEMM (FP8 weight converted to BF16 in registers, x per-row BF16 scales), after an in-place
//    inverse-RoPE pass over o's RoPE dims. Needs the prepared per-row scales (w_scale_rows).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dsv4::cuda {

enum class WoAPath { kAuto, kWeightStream, kTensorCore };

struct WoAParams {
  // [T, num_heads, 512], the attention output. Its RoPE dims are overwritten with their
  // de-rotated values on the kTensorCore path (read-only on kWeightStream); callers must not
  // rely on either.
  __nv_bfloat16* o = nullptr;
  const float2* cos_sin = nullptr;  // [T, 32] (rope_cos_sin at the query positions)
  int num_tokens = 0;
  int num_heads = 0;
  int o_groups = 0;
  int o_lora = 0;
  const uint8_t* w = nullptr;        // [o_groups*o_lora, in_g] e4m3 (the checkpoint's wo_a)
  const uint8_t* w_scale = nullptr;  // [o_groups*o_lora/128, in_g/128] UE8M0 (kWeightStream)
  const __nv_bfloat16* w_scale_rows = nullptr;  // wo_a_prepare_scales output (kTensorCore)
  __nv_bfloat16* z = nullptr;                   // [T, o_groups*o_lora] out
  WoAPath path = WoAPath::kAuto;
  // kWeightStream: launch programmatically — the kernel prefetches its weight rows into L2,
  // then waits in griddepcontrol.wait for the kernel before it before reading o (so the weight
  // stream starts under that kernel's tail); graph-capturable. (kTensorCore ignores it.)
  bool pdl = false;
};

// Largest M the weight-streaming kernel takes, and the default switch point of kAuto.
constexpr int kWoAWeightStreamMaxM = 64;
constexpr int kWoAAutoWeightStreamMaxM = 32;

void attn_output_wo_a(const WoAParams& p, cudaStream_t stream = nullptr);

// Elements of the per-row scale tensor the kTensorCore path reads: [o_groups, in_g/128, o_lora]
// BF16, element (g, kb, r) = the UE8M0 scale of row g*o_lora + r, K block kb (exact in BF16).
size_t wo_a_scale_rows_elems(int o_groups, int o_lora, int in_g);
void wo_a_prepare_scales(const uint8_t* w_scale, int o_groups, int o_lora, int in_g,
                         __nv_bfloat16* w_scale_rows, cudaStream_t stream = nullptr);

// The inverse RoPE alone, in place on o's RoPE dims (what the kTensorCore path runs first).
void inverse_rope_inplace(__nv_bfloat16* o, const float2* cos_sin, int num_tokens, int num_heads,
                          cudaStream_t stream = nullptr);

}  // namespace dsv4::cuda
