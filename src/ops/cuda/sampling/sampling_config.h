// Geometry of the sampling kernels (sampling.cu): a thread-block cluster of 1 ..
// kMaxBlocksPerRow blocks of kThreads per logits row (as many as spread the rows over the SMs),
// each block streaming its part of the row once per pass; selections (top-k, top-p, the raw top
// alternatives) are radix searches over 32-bit order keys, kDigitBits per pass.
#pragma once

namespace dsv4::cuda::sampling_cfg {

constexpr int kThreads = 512;        // per block
constexpr int kMaxBlocksPerRow = 8;  // a row's cluster: the portable maximum
constexpr int kDigitBits = 8;        // 4 passes per 32-bit key search
constexpr int kBuckets = 1 << kDigitBits;
constexpr int kUnroll = 4;          // float4 loads in flight per thread while streaming a row
constexpr int kTieCapacity = 64;    // ties of the top_n-th key collected in one pass
constexpr int kPatchThreads = 256;  // the patch kernel: one thread per patched token

}  // namespace dsv4::cuda::sampling_cfg
