// Device helpers shared by the MoE kernels: launches with programmatic dependent launch,
// cp.async, and the reference's FP8 activation quantisation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "ops/cuda/common/cuda_check.h"

namespace dsv4::cuda::moe {

struct LaunchCtx {
  cudaStream_t stream = nullptr;
  bool pdl = true;
};

// Launches `kernel`, allowing it to start while the previous kernel on the stream finishes
// (every MoE kernel waits for its predecessor with griddep_wait() before touching its data).
// On the legacy default stream the launch is a plain one.
template <typename... KArgs, typename... Args>
void launch_kernel(const LaunchCtx& c, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                   Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = c.stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = c.pdl && c.stream != nullptr ? 1 : 0;
  DSV4_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

#if defined(__CUDACC__)

// Waits until the preceding kernel on the stream has completed and its writes are visible
// (a no-op without programmatic dependent launch); then lets the next kernel launch.
__device__ __forceinline__ void griddep_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy, bypassing L1; src_bytes = 0 writes zeros.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Shared memory written through the generic proxy (cp.async, st.shared) and read next by the
// tensor cores (async proxy).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}
__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// 2^ceil(log2(v)) from the IEEE bits (the reference's fast_round_scale; v > 0, finite).
__device__ __forceinline__ float pow2_ceil_dev(float v) {
  const uint32_t b = __float_as_uint(v);
  const int e = int((b >> 23) & 0xff) - 127 + ((b & 0x7fffff) != 0 ? 1 : 0);
  return __uint_as_float(uint32_t(e + 127) << 23);
}

// Scale of one FP8 block with absolute maximum `amax`: 2^ceil(log2(max(amax, 1e-4) / 448)),
// the reciprocal of 448 as a float exactly as cpu::fp8_block_scale.
__device__ __forceinline__ float fp8_block_scale_dev(float amax) {
  return pow2_ceil_dev(__fmul_rn(fmaxf(amax, 1e-4f), 1.0f / 448.0f));
}

// q(x) * s with q = e4m3(clamp(x / s, -448, 448)) (round to nearest even), as a float
// (exactly a BF16 value). x / s is exact (s is a power of two). NaN stays NaN, as std::clamp
// and the CPU's e4m3 encoder leave it.
__device__ __forceinline__ float fp8_fake_quant(float x, float s) {
  const float r = __fdiv_rn(x, s);
  const float v = r < -448.0f ? -448.0f : (r > 448.0f ? 448.0f : r);
  const __nv_fp8_e4m3 q(v);  // satfinite, round to nearest even
  return __fmul_rn(static_cast<float>(q), s);
}

#endif  // __CUDACC__

}  // namespace dsv4::cuda::moe
