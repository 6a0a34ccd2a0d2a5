#pragma once
#include <cstdint>
#include "ops/cuda/common/sm90/smem.cuh"
namespace dsv4::cuda::sm90 {
inline void mbar_init(uint64_t* bar, uint32_t count) {
  ::kemu::mbar_init(bar, int(count));
}
inline void fence_barrier_init() {}
inline void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  ::kemu::mbar_arrive(bar, bytes);
}
inline void mbar_arrive(uint64_t* bar) {
  ::kemu::mbar_arrive(bar, 0);
}
inline void mbar_wait(uint64_t* bar, uint32_t parity) {
  ::kemu::mbar_wait(bar, parity);
}
inline void mbar_arrive_cluster(uint32_t addr) {
  ::kemu::mbar_arrive(static_cast<uint64_t*>(::kemu::smem_ptr(addr)), 0);
}
inline void mbar_wait_cluster(uint64_t* bar, uint32_t parity) {
  ::kemu::mbar_wait(bar, parity);
}
}  // namespace dsv4::cuda::sm90
