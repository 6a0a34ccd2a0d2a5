// Pseudo-random benchmark inputs filled on the device (a hash of the element index and a seed,
// so gigabytes of weights need no host copy). Timing does not depend on the values; they only
// have to be finite and of a sane magnitude.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace dsv4::bench {

__device__ __forceinline__ uint32_t index_hash(size_t i, uint32_t seed) {
  uint32_t x = uint32_t(i) * 2654435761u ^ seed;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return x;
}

// Bytes of the hash under `mask` (0x77: e4m3 codes without NaN or Inf).
__global__ void fill_bytes_kernel(uint8_t* p, size_t n, uint32_t seed, uint8_t mask) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint8_t(index_hash(i, seed)) & mask;
}
// BF16 values in [-1000, 1000] * scale.
__global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(float(int(index_hash(i, seed) % 2001) - 1000) * scale);
}
// fp32 values in [lo, hi).
__global__ void fill_f32_kernel(float* p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = lo + (hi - lo) * float(index_hash(i, seed) % 10007) / 10007.0f;
}
__global__ void fill_f32_const_kernel(float* p, size_t n, float v) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

// BF16 bit patterns of roughly unit variance (a triangular distribution on [-2.4, 2.4]).
__global__ void fill_bf16_triangular_kernel(uint16_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    const float f = 2.4f * (float(h & 0xffff) / 65536.0f + float(h >> 16) / 65536.0f - 1.0f);
    uint32_t b;
    memcpy(&b, &f, 4);
    x[i] = uint16_t(b >> 16);
  }
}

}  // namespace dsv4::bench
