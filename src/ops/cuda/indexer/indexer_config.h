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

// Top-k (indexer_topk.cu): a row spread over a cluster of 1, 2, 4 or 8 CTAs of kTopkThreads
// threads, each thread holding 8, 16, 32 or 64 of its entries in registers (so one cluster
// covers kIndexerMaxVisible = 8 x 512 x 64 entries); winners sorted by a bitonic network of
// kSortCap. By default the cluster grows while the grid stays within kTopkCtasPerSm CTAs an SM
// and chunks keep at least kTopkMinChunk entries, then further while threads would hold more
// than kTopkPreferKpt entries. H200, 2026-12-04 (indexer_bench --topk, back to back, µs, 1 / 2 /
// 4 / 8 CTAs a row): b=1 4K entries 10.2 / 12.2 / 12.4 / 13.3; b=1 16K 16.7 / 14.9 / 12.5 /
// 12.8; b=1 32K 25.0 / 18.3 / 15.2 / 14.0; b=32 16K 17.4 / 15.8 / 16.3 / 21.3; b=32 32K 26.4 /
// 19.6 / 19.6 / 22.3; b=128 16K 17.9 / 19.9 / 30.5 / 50.3; b=128 32K 27.1 / 25.4 / 34.1 / 52.2.
constexpr int kTopkThreads = 512;
constexpr int kSortCap = 1024;      // = kIndexerMaxTopk, the bitonic sort width
constexpr int kTopkMaxCluster = 8;  // portable cluster size
constexpr int kTopkMinKpt = 8, kTopkMaxKpt = 64, kTopkPreferKpt = 32;
constexpr int kTopkCtasPerSm = 1;
constexpr int kTopkMinChunk = 4096;

}  // namespace dsv4::cuda::indexer_cfg
