// W8A16 linears: the activation round trip through e4m3, then the wo_a W8A16 kernels.
#include "ops/cuda/gemm/w8a16_linear.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/attn_output/attn_output.h"
#include "ops/cuda/attn_output/attn_output_config.h"
#include "ops/cuda/attn_output/wo_a_kernels.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4::cuda {
namespace {

constexpr int kThreads = 256;  // a half-warp per 128-element block, 8 elements per lane

__device__ __forceinline__ uint32_t pow2_ceil_exponent(float v) {
  const uint32_t b = __float_as_uint(v);
  return ((b >> 23) & 0xffu) + ((b & 0x7fffffu) != 0u ? 1u : 0u);
}

// The same scale and codes as act_quant_kernel (act_quant.cu), decoded: code x 2^(e-127).
__global__ void __launch_bounds__(kThreads)
    fake_quant_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx, int m, int k,
                      __nv_bfloat16* __restrict__ xq) {
  const int kb_per_row = k / 128;
  const int64_t blocks = int64_t(m) * kb_per_row;
  const int half = (threadIdx.x & 31) >> 4, hl = threadIdx.x & 15;
  const int64_t warp_id = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int64_t warps = int64_t(gridDim.x) * kThreads / 32;
  for (int64_t wb = warp_id * 2; wb < blocks; wb += warps * 2) {
    const int64_t blk = wb + half;
    const bool valid = blk < blocks;
    const int64_t row = valid ? blk / kb_per_row : 0;
    const int kb = valid ? int(blk % kb_per_row) : 0;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (valid)
      raw = __ldg(reinterpret_cast<const uint4*>(x + row * ldx + int64_t(kb) * 128 + hl * 8));
    const __nv_bfloat16* xv = reinterpret_cast<const __nv_bfloat16*>(&raw);
    float v[8];
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = __bfloat162float(xv[i]);
      a = fmaxf(a, fabsf(v[i]));
    }
#pragma unroll
    for (int o = 8; o >= 1; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    const uint32_t e = pow2_ceil_exponent(fmaxf(a, 1e-4f) * (1.0f / 448.0f));
    const float inv_s = __uint_as_float((254u - e) << 23);
    const float s = __uint_as_float(e << 23);
    __align__(16) __nv_bfloat16 out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const __nv_fp8_storage_t c = __nv_cvt_float_to_fp8(v[i] * inv_s, __NV_SATFINITE, __NV_E4M3);
      const float d = __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3)));
      out[i] = __float2bfloat16_rn(d * s);  // exact: 4 significant bits x 2^(e-127)
    }
    if (valid)
      *reinterpret_cast<uint4*>(xq + row * k + int64_t(kb) * 128 + hl * 8) =
          *reinterpret_cast<const uint4*>(out);
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

void fake_quant_act_bf16(const __nv_bfloat16* x, int64_t ldx, int m, int k, __nv_bfloat16* xq,
                         cudaStream_t stream) {
  DSV4_CHECK(m >= 0 && k > 0 && k % 128 == 0, "fake_quant_act_bf16: k = ", k,
             " must be a positive multiple of 128 (m = ", m, ")");
  if (ldx == 0) ldx = k;
  DSV4_CHECK(ldx >= k && ldx % 8 == 0, "fake_quant_act_bf16: row stride ", ldx,
             " must be >= k and a multiple of 8");
  if (m == 0) return;
  DSV4_CHECK(x && xq && aligned16(x) && aligned16(xq),
             "fake_quant_act_bf16: x and xq must be non-null and 16-byte aligned");
  const int64_t blocks = int64_t(m) * (k / 128);
  const int64_t per_cta = kThreads / 16;
  const int grid = int(std::min<int64_t>((blocks + per_cta - 1) / per_cta, 1 << 20));
  fake_quant_kernel<<<grid, kThreads, 0, stream>>>(x, ldx, m, k, xq);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

size_t w8a16_scale_rows_elems(int n, int k) {
  return wo_a_scale_rows_elems(1, n, k);
}

void w8a16_prepare_scales(const uint8_t* w_scale_e8m0, int n, int k, __nv_bfloat16* scale_rows,
                          cudaStream_t stream) {
  wo_a_prepare_scales(w_scale_e8m0, 1, n, k, scale_rows, stream);
}

void w8a16_linear(const W8A16LinearParams& p, cudaStream_t stream) {
  const char* fn = "w8a16_linear";
  DSV4_CHECK(p.m >= 0 && p.n > 0 && p.n % 128 == 0 && p.k > 0 && p.k % 128 == 0, fn, ": [", p.m,
             ", ", p.k, "] x [", p.n, ", ", p.k, "]^T: n and k must be positive multiples of 128");
  const int64_t ldx = p.ldx ? p.ldx : p.k, ldy = p.ldy ? p.ldy : p.n;
  DSV4_CHECK(ldy >= p.n && ldy % 8 == 0, fn, ": output row stride ", ldy,
             " must be >= n and a multiple of 8");
  if (p.m == 0) return;
  DSV4_CHECK(p.x && p.w && p.w_scale && p.scale_rows && p.y, fn,
             ": x, w, w_scale, scale_rows and y are required");
  DSV4_CHECK(aligned16(p.w) && aligned16(p.y) && aligned16(p.scale_rows), fn,
             ": w, y and scale_rows must be 16-byte aligned");
  const __nv_bfloat16* a = p.x;
  int64_t lda = ldx;
  if (p.quantize) {
    DSV4_CHECK(p.xq != nullptr, fn, ": the quantised-activation workspace xq is required");
    fake_quant_act_bf16(p.x, ldx, p.m, p.k, p.xq, stream);
    a = p.xq;
    lda = p.k;
  }
  DSV4_CHECK(aligned16(a) && lda % 8 == 0, fn, ": activations must be 16-byte aligned rows");
  WoAArgs w;
  w.o = a;
  w.cos_sin = nullptr;  // no RoPE
  w.num_tokens = p.m;
  w.ldo = lda;
  w.in_g = p.k;
  w.o_groups = 1;
  w.o_lora = p.n;
  w.w = p.w;
  w.w_scale = p.w_scale;
  w.w_scale_rows = p.scale_rows;
  w.z = p.y;
  w.ldz = ldy;
  if (p.m <= kWoAAutoWeightStreamMaxM && p.k % attn_output_cfg::kWsStageK == 0)
    wo_a_weight_stream(w, stream);
  else
    wo_a_tensor_core(w, stream);
}

}  // namespace dsv4::cuda
