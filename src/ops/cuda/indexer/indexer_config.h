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

// Query path: a CTA per (token, group of kQueryWarps x R heads); a warp per head row, 4 values
// per lane, each warp's R rows (heads w, w + kQueryWarps, ...) loaded together; the CTA's warp 0
// computes the token's RoPE cos/sin once (they do not depend on the head: computing them per
// (token, head) in double precision was most of the kernel, 354 us at the 8K prefill on the
// H200). R = kQueryRowsPrefill (a CTA per token) from kQueryPrefillTokens tokens, else 1 (one
// row a warp keeps a decode step's latency at one row's: 8 rows a warp took 9.3 us at b = 1).
constexpr int kQueryWarps = 8;
constexpr int kQueryRowsPrefill = (kMaxHeads + kQueryWarps - 1) / kQueryWarps;
constexpr int kQueryPrefillTokens = 512;
constexpr int kRopePairs = kRopeDim / 2;

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
// kSortCap. By default (indexer.cpp, topk_plan) the cluster size within the grid budget
// (kTopkCtasPerSm CTAs an SM) that gives threads the fewest entries, then a larger one while
// threads would hold more than kTopkPreferKpt. H200, 2026-12-04 (indexer_bench --topk, back to
// back, µs, 1 / 2 / 4 / 8 CTAs a row): b=1 4K entries 10.0 / 12.0 / 12.3 / 13.2; b=1 16K 16.5 /
// 14.7 / 12.3 / 12.6; b=1 32K 24.9 / 18.2 / 15.1 / 13.8; b=32 16K 17.2 / 15.7 / 16.2 / 21.1;
// b=32 32K 26.3 / 19.4 / 19.6 / 22.2; b=128 16K 17.8 / 19.7 / 30.5 / 50.2; b=128 32K 26.9 /
// 25.1 / 33.2 / 51.9.
constexpr int kTopkThreads = 512;
constexpr int kSortCap = 1024;      // = kIndexerMaxTopk, the bitonic sort width
constexpr int kTopkMaxCluster = 8;  // portable cluster size
constexpr int kTopkMinKpt = 8, kTopkMaxKpt = 64, kTopkPreferKpt = 32;
constexpr int kTopkCtasPerSm = 1;

}  // namespace dsv4::cuda::indexer_cfg
