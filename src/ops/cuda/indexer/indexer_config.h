// Tile geometry of the lightning-indexer kernels.
#pragma once

namespace dsv4::cuda::indexer_cfg {

constexpr int kHeadDim = 128;
constexpr int kRopeDim = 64;
constexpr int kFp4Block = 32;
constexpr int kKeyBytes = kHeadDim / 2;           // packed e2m1 per key
constexpr int kKeyScales = kHeadDim / kFp4Block;  // UE8M0 per key
// Heads: the logits kernel runs 8, 16, 32 or 64 (its MMA width), fewer padded with zeros.
constexpr int kMaxHeads = 64;

// Query path: one warp per (token, head), 4 values per lane.
constexpr int kQueryWarps = 4;

// Logits: 4 warps x 32 keys (two m16 tiles) per key tile; up to 4 query tokens of one sequence
// per CTA share the dequantised keys; key tiles stream through a 3-stage cp.async ring.
constexpr int kLogitsWarps = 4;
constexpr int kLogitsThreads = kLogitsWarps * 32;
constexpr int kKeysPerWarp = 32;
constexpr int kTileKeys = kLogitsWarps * kKeysPerWarp;  // 128
constexpr int kStages = 3;
constexpr int kMaxTokensPerCta = 4;
constexpr int kQRowPad = 8;  // BF16 elements of padding per q row in smem (conflict-free ldmatrix)
constexpr int kMaxKeysPerCta = 2048;

// Logits on warpgroup MMA (indexer_logits_wgmma.cu): one warpgroup a CTA, 64 keys a tile (the
// wgmma's M), a 4-stage ring of key tiles (bulk copies, or cp.async per key), up to
// kMaxTokensPerCta tokens of one sequence sharing each decoded tile; key chunks sized for about
// kWgCtasPerSm CTAs an SM.
constexpr int kWgThreads = 128;
constexpr int kWgTileKeys = 64;
constexpr int kWgStages = 4;
constexpr int kWgMaxKeysPerCta = 2048;
constexpr int kWgCtasPerSm = 4;
// Launch bounds: one token a chain at most 168 registers a thread (ptxas takes 128: 4 CTAs an
// SM), two tokens a chain at most 255 (it takes 167: 2 CTAs an SM).
constexpr int kWgMinCtasPerSm = 3;
constexpr int kWgMinCtasPerSmPaired = 2;

// Top-k: one CTA selects over a segment of at most kSegment entries (16-bit positions); longer
// rows are cut into segments whose candidates a second pass merges.
constexpr int kTopkThreads = 512;
constexpr int kSegment = 16384;
constexpr int kSortCap = 1024;  // = kIndexerMaxTopk, the bitonic sort width
// Small batches (issue 17 point 3): launches of at most kTopkSmallBatch tokens whose rows hold
// more than kTopkMinSplit entries run the cluster path (indexer_topk.cu: kTopkCluster CTAs per
// token, one contiguous chunk each, the selection merged in distributed shared memory). Forced
// onto the segment path (IndexerTopkPath::kSegments) they cut rows into segments of about
// sqrt(visible x k) entries (segment pass and merge of equal size). H200, 2026-12-02
// (indexer_bench --topk, single-launch timer, µs, cluster vs segments): b=1 4K entries 17.95 vs
// 17.98 (the segment path's one CTA), 16K 18.4 vs 25.8, 32K 21.1 vs 25.4, 32K top-1024 21.9 vs
// 33.7; b=2 alike. The batch bound is unmeasured above 2 tokens; 8192 entries lies between
// the measured 4K (a tie) and 16K.
constexpr int kTopkSmallBatch = 16;
constexpr int kTopkMinSplit = 8192;
constexpr int kTopkCluster = 8;  // portable cluster size

}  // namespace dsv4::cuda::indexer_cfg
