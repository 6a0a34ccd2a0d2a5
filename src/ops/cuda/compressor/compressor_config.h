// Tile geometry of the compressor kernels. A block's pooling reads `rows` state/token rows of
// its channels: ratio 4 (8 rows x 512 channels = 32 KB) fits one CTA; ratio 128 (128 rows x 512
// channels x kv+score = 512 KB) is split over a cluster of 8 CTAs of 64 channels each, whose
// RMSNorm partial sums meet through distributed shared memory.
#pragma once

namespace dsv4::cuda {

template <int kRatio_, int kDim_>
struct CompressorConfig {
  static constexpr int kRatio = kRatio_;
  static constexpr int kDim = kDim_;
  static constexpr bool kIndexer = kDim == 128;  // indexer compressor: Hadamard + MXFP4
  static constexpr int kCoff = kRatio == 4 ? 2 : 1;
  static constexpr int kRows = kCoff * kRatio;  // state rows (kv, and as many score rows)
  static constexpr int kWidth = kCoff * kDim;   // state row width (floats)
  static constexpr int kTile = kRatio == 128 ? 64 : kDim;  // channels per CTA
  static constexpr int kCluster = kDim / kTile;            // CTAs per block (<= 8, portable)
  static constexpr int kThreads = kTile >= 256 ? 256 : (kRatio == 128 ? 256 : kTile);
  static constexpr int kWarps = kThreads / 32;
  // Row partitions for the parallel (order-free) steps: max and exp per channel.
  static constexpr int kParts = kThreads >= kTile ? kThreads / kTile : 1;
  static constexpr int kRowsPerPart = kRows / kParts;

  static_assert(kRatio == 4 || kRatio == 128, "ratio 4 or 128");
  static_assert(kDim == 512 || (kDim == 128 && kRatio == 4), "d 512, or 128 for the indexer");
  static_assert(kDim % kTile == 0 && kTile % 64 == 0 && kCluster <= 8, "tile");
  static_assert(kRows % kParts == 0 && (kRows * kTile / 4) % kThreads == 0, "load split");

  // Dynamic shared memory: kv and score tiles, per-part maxima, sums, the entry values.
  static constexpr int kSmemFloats = 2 * kRows * kTile + kParts * kTile + 2 * kTile;
  static constexpr int kSmemBytes = kSmemFloats * 4;
};

}  // namespace dsv4::cuda
