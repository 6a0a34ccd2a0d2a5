// Register layout of the streaming GEMM's accumulators (host and device, so tests can check it):
// wgmma m64nNk accumulators, register i of thread (warp w, lane l) of m64 tile t hold weight row
// t*64 + w*16 + l/4 + 8*((i>>1)&1) and token (i>>2)*8 + (l%4)*2 + (i&1). The epilogue stores them
// in register order, at ((t*(N/2) + i) * 128 + w*32 + l), and reads them back by (row, token).
#pragma once

#if defined(__CUDACC__)
#define DSV4_HD __host__ __device__ __forceinline__
#else
#define DSV4_HD inline
#endif

namespace dsv4::cuda::stream_gemm {

struct AccCoord {
  int row;  // weight row within the CTA's 128
  int col;  // token
};

template <int kMT>
DSV4_HD AccCoord acc_coord(int t, int i, int thread) {
  const int w = thread >> 5, l = thread & 31;
  return {t * 64 + w * 16 + (l >> 2) + 8 * ((i >> 1) & 1), (i >> 2) * 8 + (l & 3) * 2 + (i & 1)};
}

template <int kMT>
DSV4_HD int acc_store_index(int t, int i, int thread) {
  return (t * (kMT / 2) + i) * 128 + thread;
}

// Inverse of acc_coord composed with acc_store_index.
template <int kMT>
DSV4_HD int partial_index(int row, int col) {
  const int t = row >> 6, w = (row >> 4) & 3, r16 = row & 15;
  const int i = (col >> 3) * 4 + (r16 >> 3) * 2 + (col & 1);
  const int lane = (r16 & 7) * 4 + ((col & 7) >> 1);
  return acc_store_index<kMT>(t, i, w * 32 + lane);
}

}  // namespace dsv4::cuda::stream_gemm

#undef DSV4_HD
