#pragma once
#include <cstdint>
#include <cstring>
#include "ops/cuda/common/numerics.cuh"
#include "ops/cuda/common/sm90/smem.cuh"
namespace dsv4::cuda::sm90 {
namespace kemu_detail {
inline float half_of(uint32_t v, int h) {
  return h ? num::bf16_hi(v) : num::bf16_lo(v);
}
// ldmatrix: lanes 8j..8j+7 give the row addresses of matrix j (j < count).
inline void ldmatrix(uint32_t* r, int count, bool trans, const void* p) {
  uint8_t all[32][64];
  const uint8_t* mine = static_cast<const uint8_t*>(p);
  ::kemu::warp_gather(0xffffffffu, &mine, sizeof(mine), all);
  const int l = ::kemu::lane();
  for (int j = 0; j < count; ++j) {
    uint16_t e[2];
    for (int h = 0; h < 2; ++h) {
      int row, col;
      if (!trans) {
        row = l / 4;
        col = 2 * (l % 4) + h;
      } else {
        row = 2 * (l % 4) + h;
        col = l / 4;
      }
      const uint8_t* rp;
      std::memcpy(&rp, all[8 * j + row], sizeof(rp));
      std::memcpy(&e[h], rp + 2 * col, 2);
    }
    r[j] = uint32_t(e[0]) | (uint32_t(e[1]) << 16);
  }
}
// The x4 forms: four 8x8 matrices, one register each.
inline void ldmatrix4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, bool trans,
                      const void* p) {
  uint32_t r[4];
  ldmatrix(r, 4, trans, p);
  r0 = r[0];
  r1 = r[1];
  r2 = r[2];
  r3 = r[3];
}
}  // namespace kemu_detail
inline void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* p) {
  kemu_detail::ldmatrix4(r0, r1, r2, r3, false, p);
}
inline void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* p) {
  uint32_t r[2];
  kemu_detail::ldmatrix(r, 2, false, p);
  r0 = r[0];
  r1 = r[1];
}
inline void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                              const void* p) {
  kemu_detail::ldmatrix4(r0, r1, r2, r3, true, p);
}
// mma.sync m16n8k16 row.col f32.bf16.bf16.f32: products exact in fp32, summed in k order.
inline void mma_bf16_16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                           uint32_t b0, uint32_t b1) {
  uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  uint8_t all[32][64];
  ::kemu::warp_gather(0xffffffffu, mine, sizeof(mine), all);
  auto reg = [&](int lane, int i) {
    uint32_t v;
    std::memcpy(&v, all[lane] + 4 * i, 4);
    return v;
  };
  auto A = [&](int r, int k) {
    const int lane = (r % 8) * 4 + (k % 8) / 2;
    const int i = (r < 8 ? 0 : 1) + (k < 8 ? 0 : 2);
    return kemu_detail::half_of(reg(lane, i), k % 2);
  };
  auto B = [&](int k, int n) {
    const int lane = n * 4 + (k % 8) / 2;
    return kemu_detail::half_of(reg(lane, k < 8 ? 4 : 5), k % 2);
  };
  const int l = ::kemu::lane(), g = l / 4, tq = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int r = g + (i >= 2 ? 8 : 0), c = 2 * tq + (i & 1);
    double s = 0.0;
    for (int k = 0; k < 16; ++k) s += double(A(r, k)) * double(B(k, c));
    d[i] = float(double(d[i]) + s);
  }
}
inline void mma_bf16_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  mma_bf16_16816(d, a[0], a[1], a[2], a[3], b0, b1);
}
}  // namespace dsv4::cuda::sm90
