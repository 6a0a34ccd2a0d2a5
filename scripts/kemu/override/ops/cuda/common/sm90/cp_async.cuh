#pragma once
#include <cstdint>
#include "ops/cuda/common/sm90/smem.cuh"
namespace dsv4::cuda::sm90 {
inline void cp_async_16(uint32_t a, const void* g) {
  ::kemu::cp_async(::kemu::smem_ptr(a), g, 16, 16);
}
inline void cp_async_16(void* s, const void* g) {
  ::kemu::cp_async(s, g, 16, 16);
}
inline void cp_async_16_zfill(uint32_t a, const void* g, int n) {
  ::kemu::cp_async(::kemu::smem_ptr(a), g, 16, n);
}
inline void cp_async_16_zfill(void* s, const void* g, int n) {
  ::kemu::cp_async(s, g, 16, n);
}
inline void cp_async_8(void* s, const void* g) {
  ::kemu::cp_async(s, g, 8, 8);
}
inline void cp_async_4(void* s, const void* g) {
  ::kemu::cp_async(s, g, 4, 4);
}
inline void cp_async_commit() {
  ::kemu::cp_async_commit();
}
template <int N>
inline void cp_async_wait() {
  ::kemu::cp_async_wait(N);
}
inline void cp_async_mbar_arrive_noinc(uint64_t* bar) {
  ::kemu::cp_async_mbar_arrive(bar);
}
}  // namespace dsv4::cuda::sm90
