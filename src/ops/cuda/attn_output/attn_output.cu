// Output path: validation, path choice, the in-place inverse RoPE and the scale preparation.
#include "ops/cuda/attn_output/attn_output.h"

#include <cstdint>

#include "core/error.h"
#include "ops/cuda/attn_output/attn_output_config.h"
#include "ops/cuda/attn_output/wo_a_kernels.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/numerics.cuh"

namespace dsv4::cuda {
namespace {

using namespace attn_output_cfg;

bool aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// Thread (t, h, q): RoPE dims 448 + 8q .. +7 of head h of token t (pairs 4q .. 4q+3).
__global__ void __launch_bounds__(kRopeThreads)
    inverse_rope_kernel(__nv_bfloat16* o, const float2* __restrict__ cos_sin, int num_tokens,
                        int num_heads) {
  const int64_t idx = int64_t(blockIdx.x) * kRopeThreads + threadIdx.x;
  if (idx >= int64_t(num_tokens) * num_heads * 8) return;
  const int q = int(idx % 8);
  const int64_t th = idx / 8;  // t * num_heads + h
  const int t = int(th / num_heads);
  uint4* p = reinterpret_cast<uint4*>(o + th * 512 + 448 + 8 * q);
  float x[8];
  num::unpack8(*p, x);
  const float2* cs = cos_sin + int64_t(t) * 32 + 4 * q;
#pragma unroll
  for (int j = 0; j < 4; ++j) num::rope_pair(x[2 * j], x[2 * j + 1], cs[j], true);
  *p = num::pack8(x);
}

__global__ void prepare_scales_kernel(const uint8_t* __restrict__ w_scale, int o_groups, int o_lora,
                                      int kblocks, __nv_bfloat16* out) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(o_groups) * kblocks * o_lora) return;
  const int r = int(idx % o_lora);
  const int kb = int((idx / o_lora) % kblocks);
  const int g = int(idx / (int64_t(o_lora) * kblocks));
  const int row = g * o_lora + r;
  out[idx] = __float2bfloat16_rn(num::e8m0_to_float(w_scale[int64_t(row / 128) * kblocks + kb]));
}

void check_shape(int num_heads, int o_groups, int o_lora, const char* fn) {
  DSV4_CHECK(num_heads > 0 && o_groups > 0 && num_heads % o_groups == 0, fn, ": ", num_heads,
             " heads do not split into ", o_groups, " groups");
  DSV4_CHECK(o_lora > 0 && o_lora % 128 == 0, fn, ": o_lora ", o_lora,
             " must be a positive multiple of 128 (FP8 scale blocks)");
}

}  // namespace

size_t wo_a_scale_rows_elems(int o_groups, int o_lora, int in_g) {
  return size_t(o_groups) * (in_g / 128) * o_lora;
}

void wo_a_prepare_scales(const uint8_t* w_scale, int o_groups, int o_lora, int in_g,
                         __nv_bfloat16* w_scale_rows, cudaStream_t stream) {
  DSV4_CHECK(o_groups > 0 && o_lora > 0 && o_lora % 128 == 0 && in_g > 0 && in_g % 128 == 0,
             "wo_a_prepare_scales: bad shape (groups ", o_groups, ", o_lora ", o_lora, ", in_g ",
             in_g, ")");
  DSV4_CHECK(w_scale && w_scale_rows, "wo_a_prepare_scales: null pointer");
  const int64_t n = int64_t(wo_a_scale_rows_elems(o_groups, o_lora, in_g));
  prepare_scales_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(w_scale, o_groups, o_lora,
                                                                       in_g / 128, w_scale_rows);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void inverse_rope_inplace(__nv_bfloat16* o, const float2* cos_sin, int num_tokens, int num_heads,
                          cudaStream_t stream) {
  DSV4_CHECK(num_tokens >= 0 && num_heads > 0, "inverse_rope_inplace: tokens ", num_tokens,
             ", heads ", num_heads);
  if (num_tokens == 0) return;
  DSV4_CHECK(o && cos_sin && aligned(o, 16),
             "inverse_rope_inplace: o (16-byte aligned) and "
             "cos_sin required");
  const int64_t n = int64_t(num_tokens) * num_heads * 8;
  inverse_rope_kernel<<<unsigned((n + kRopeThreads - 1) / kRopeThreads), kRopeThreads, 0, stream>>>(
      o, cos_sin, num_tokens, num_heads);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void attn_output_wo_a(const WoAParams& p, cudaStream_t stream) {
  const char* fn = "attn_output_wo_a";
  check_shape(p.num_heads, p.o_groups, p.o_lora, fn);
  DSV4_CHECK(p.num_tokens >= 0, fn, ": num_tokens ", p.num_tokens);
  if (p.num_tokens == 0) return;
  DSV4_CHECK(p.o && p.cos_sin && p.w && p.z, fn, ": o, cos_sin, w and z are required");
  DSV4_CHECK(aligned(p.o, 16) && aligned(p.w, 16) && aligned(p.z, 16), fn,
             ": o, w and z must be 16-byte aligned");
  WoAArgs a;
  a.o = p.o;
  a.cos_sin = p.cos_sin;
  a.num_tokens = p.num_tokens;
  a.ldo = int64_t(p.num_heads) * 512;
  a.in_g = p.num_heads / p.o_groups * 512;
  a.o_groups = p.o_groups;
  a.o_lora = p.o_lora;
  a.w = p.w;
  a.w_scale = p.w_scale;
  a.w_scale_rows = p.w_scale_rows;
  a.z = p.z;
  a.ldz = int64_t(p.o_groups) * p.o_lora;
  a.pdl = p.pdl;

  WoAPath path = p.path;
  if (path == WoAPath::kAuto)
    path = p.num_tokens <= kWoAAutoWeightStreamMaxM ? WoAPath::kWeightStream : WoAPath::kTensorCore;
  if (path == WoAPath::kWeightStream) {
    DSV4_CHECK(p.num_tokens <= kWoAWeightStreamMaxM, fn,
               ": the weight-streaming kernel takes at "
               "most ",
               kWoAWeightStreamMaxM, " tokens (got ", p.num_tokens, ")");
    DSV4_CHECK(p.w_scale != nullptr, fn, ": w_scale (UE8M0 blocks) required");
    wo_a_weight_stream(a, stream);
  } else {
    DSV4_CHECK(p.w_scale_rows != nullptr && aligned(p.w_scale_rows, 16), fn,
               ": the tensor-core path needs w_scale_rows (wo_a_prepare_scales), 16-byte aligned");
    inverse_rope_inplace(p.o, p.cos_sin, p.num_tokens, p.num_heads, stream);
    wo_a_tensor_core(a, stream);
  }
}

}  // namespace dsv4::cuda
