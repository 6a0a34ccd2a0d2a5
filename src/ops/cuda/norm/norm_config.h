// Geometry of the RMSNorm kernel (norm.cu): a group of G threads per row (G = 32, 128 or 256,
// by width), each thread holding up to kMaxChunks 16-byte chunks of the row in registers.
#pragma once

namespace dsv4::cuda::norm_cfg {

constexpr int kThreads = 256;
constexpr int kMaxChunks = 8;                         // 8 BF16 each
constexpr int kMaxWidth = kThreads * kMaxChunks * 8;  // 16384
// Up to this many rows (decode-sized steps) the kernel loads its weight before its
// programmatic-launch wait, holding it in registers.
constexpr int kEarlyMaxRows = 64;

// Threads per row for a width of n (multiple of 8).
constexpr int group_for(int n) {
  const int chunks = n / 8;
  return chunks <= 32 * kMaxChunks ? 32 : chunks <= 128 * kMaxChunks ? 128 : 256;
}

}  // namespace dsv4::cuda::norm_cfg
