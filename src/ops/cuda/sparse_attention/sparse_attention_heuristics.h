// The measured data the sparse-attention planner (sparse_attention_plan.cpp) decides by, kept
// apart from the kernels: which kernel runs a head count, and the constants of the cost model
// that picks heads per CTA and key splits. Every figure is an H200 measurement from
// bench/results/kernels-h200.md, sections "sparse_attention[mma]" and "sparse_attention[wgmma]"
// (16384 tokens of context, CUDA events, inputs rotated past L2, median of 100); when a kernel
// changes, re-measure (bench/cuda/sparse_attention_bench.cu prints the model's estimate beside
// each time) and update the figures here, not the planner.
//
// Pure data: no CUDA, so the planner is testable on the CPU (tests/sparse_attention_plan_test).
#pragma once

#include "ops/cuda/sparse_attention/sparse_attention_plan.h"

namespace dsv4::cuda::sparse_attn_heuristics {

// ---- kernel per head count ---------------------------------------------------------------
// kAuto's kernel: the first row whose head count divides n_heads and whose token range holds
// the launch. Both kernels were measured on the same plan (heads per CTA, splits) and inputs:
struct KernelRule {
  int heads_multiple;  // n_heads % heads_multiple == 0
  int min_tokens, max_tokens;
  SparseAttnKernel kernel;
};
inline constexpr KernelRule kKernelTable[] = {
    // Batch 2 (2-4 query tokens), 64 heads: mma with 16-head tiles 21.57 / 23.42 µs (Flash CSA
    // s_q 1 / 2) and 17.82 / 19.01 µs (Flash HCA) against wgmma's (64-head tiles only) 31.26 /
    // 32.16 and 27.62 / 26.72 µs: mma 1.4-1.5x faster.
    {64, 1, 31, SparseAttnKernel::kMma},
    // 128 heads (Pro), decode batches: the staged wgmma kernel WITHOUT CTA pairs (each 64-head
    // CTA gathers and decodes its whole key block), measured against the same kernel with its
    // pairs (each key block decoded once per token, shared through DSMEM) and mma's 64-head
    // tiles, same inputs (H200, 2026-12-02, commit 6bd838c, sparse_attention_bench --quick,
    // nothing else on the GPU): Pro CSA b=128 s_q 1 158.7 (unpaired) vs 226.2 (pairs) vs 239.3
    // (mma), s_q 2 311.2 vs 446.1 vs 462.1 µs: unpaired 30 % faster than pairs (the pair's
    // DSMEM hand-off costs more than the second decode saves). At b=2 mma wins (31.0 / 34.9
    // vs 36.0 / 37.3 for the older wgmma). Measured at 128 and 256 tokens; held up to 1024
    // (b=256 x s_q 4), where each CTA still streams its own keys from HBM. Prefill too
    // (H200, 2026-12-04, sparse_attention_bench --batches 128): Pro CSA s_q 4096 at 8K context
    // 4457 µs (unpaired) vs 6531 (pairs) vs 6731 (mma); s_q 8192 at 16K 8824 vs 12966 vs 13386.
    {128, 128, 1 << 30, SparseAttnKernel::kWgmmaUnpaired},
    // 64 heads (Flash), 128-1024 decode tokens: the wgmma kernel with its staged producer (raw
    // entries copied into shared memory two blocks ahead of the decode) against mma's 64-head
    // tiles, same plan (one split) and inputs (H200, 2026-12-02 13:07, sparse_attention_bench
    // --quick): b=128 Flash CSA s_q 1 58.1 vs 81.0 µs, s_q 2 106.9 vs 146.7; Flash HCA 37.4 vs
    // 44.7, 64.2 vs 78.3; HCA <= 1024 entries 79.9 vs 122.2, 132.2 vs 197.3: wgmma 16-35 %
    // faster (the previous producer: 96.6 / 189.1 / 50.5 / 92.0 / 148.3 / 246.1, slower than
    // mma). At batch 2 mma stays faster (21.8 vs 28.1). Measured at 128 and 256 tokens, held
    // up to 1024 like the 128-head row; 32-127 tokens unmeasured (mma, below). Prefill (H200,
    // 2026-12-04, same run as the 128-head prefill above): Flash CSA s_q 4096 at 8K context
    // 1408 µs (staged wgmma) vs 2022 (mma) vs 2193 (direct); s_q 8192 at 16K 2762 vs 3934.
    {64, 128, 1 << 30, SparseAttnKernel::kWgmma},
    // Batch 128, 64-head tiles on both (before the staged producer): Flash CSA s_q 1 89.73 (mma)
    // vs 90.02 (wgmma), s_q 2
    // 164.61 vs 166.98; Flash HCA s_q 1 44.42 vs 43.90, s_q 2 79.01 vs 85.70; Pro CSA (128
    // heads, same splits) s_q 1 788.96 vs 1027.90, s_q 2 1021.22 vs 1222.02; prefill s_q 4096
    // 6713 vs 8600. wgmma wins one shape by 1 % and loses the rest by up to 30 %: mma. Again
    // after its gather was pipelined (2026-12-02): Flash CSA b=128 s_q 1 90.9 (mma) vs 97.2,
    // s_q 2 164.6 vs 189.2; Flash HCA 47.0 vs 50.7, 83.1 vs 92.3: mma.
    {64, 32, 1 << 30, SparseAttnKernel::kMma},
    // Other head counts (4, 8, 16, 32, 48, ...): only the mma kernel runs them.
    {1, 1, 1 << 30, SparseAttnKernel::kMma},
};

// ---- cost model ----------------------------------------------------------------------------
// Both kernels run one CTA per SM (shared memory), so a launch of C CTAs takes ceil(C / SMs)
// waves of the slowest CTA. Estimated time of a plan (heads per CTA ht, s key splits of bps
// 64-key blocks each, units = tokens x head tiles):
//   kLaunchUs + waves(units x s) x (kCtaFixedUs + bps x block_us(ht) + partial_write_us(ht))
//   + (s > 1: kCombineLaunchUs + combine bytes / kHbmBytesPerUs)
// where block_us(ht) = base_us + per16_us x ht / 16 with the kernel's BlockCost (a key
// block's gather, decode and MMAs), partial_write_us = the CTA's O[512] + m + l partials (ht x 2064
// bytes) at its share (1 / SMs) of the HBM bandwidth, and the combine reads every partial once and
// writes the BF16 output (tokens x heads x (s x 2064 + 1024) bytes).
//
// Fitted to the mma rows (measured / model, µs):
//   ht 64, 1 split, one wave: Flash CSA b=128 s_q 1 (10 blocks) 89.73 / 89.0; Flash HCA
//     b=128 s_q 1 (4 blocks) 44.42 / 43.4; two waves: CSA s_q 2 164.61 / 168.0, HCA s_q 2
//     79.01 / 76.8  -> block_us(64) = 7.6, kLaunchUs + kCtaFixedUs = 13;
//   ht 16, one wave of 1-5 blocks with the combine: Flash CSA b=2 s_q 1 (10 splits) 21.57 /
//     20.9, s_q 2 (5 splits) 23.42 / 24.5; Flash HCA b=2 s_q 1 (4 splits) 17.82 / 20.4; Pro
//     CSA b=2 s_q 1 (6 splits) 28.93 / 28.3, s_q 2 (4 splits) 38.59 / 35.8 -> block_us(16)
//     ~ 3.5, kCombineLaunchUs = 2;
//   many waves of 1-2 blocks with the partials and the combine: Pro CSA b=128 s_q 1 (18
//     splits, 35 waves) 788.96 / 795, s_q 2 (9 splits) 1021.22 / 1066; Flash CSA prefill
//     s_q 4096 (10 splits, 311 waves) 6713 / 7009 -> kCtaFixedUs = 3 and 3 TB/s for the
//     partials; the Flash CSA s_q 2 b=256 (10 splits) 1183 against ~2 x 166 at 1 split
//     (model 889 / 326).
// tests/sparse_attention_plan_test.cpp holds the model within 25 % of each of these figures.
inline constexpr double kLaunchUs = 10.0;
inline constexpr double kCtaFixedUs = 3.0;

// block_us(ht) = base_us + per16_us x ht / 16, per kernel.
struct BlockCost {
  double base_us, per16_us;
};
inline constexpr BlockCost kMmaBlockCost{2.2, 1.35};
// wgmma (64-row tiles only, so block_us(64) = base_us), the staged producer, fitted to its
// rows of 2026-12-02 13:07 (one split, 1-4 waves; measured / model µs): unpaired (64 heads)
// Flash CSA b=128 s_q 1 58.1 / 59.0, s_q 2 106.9 / 108.0 (Flash HCA 37.4 / 31.4, 64.2 /
// 52.8) -> 4.6 (the same kernel unpaired at 128 heads, 6bd838c: Pro CSA b=128 s_q 1 158.7 /
// 182.2, s_q 2 311.2 / 354.4); CTA pairs (n_heads % 128 == 0) Pro CSA b=128 s_q 1 227.2 /
// 228.4, s_q 2 442.2 / 446.8 -> 5.9. The previous producer (kWgmmaDirect, fitted the same way to
// its rows of 09:40: Flash CSA 97.2 / 98.0, 189.2 / 186.0; Pro CSA 241.7 / 241.0, 470.3 /
// 472.0): 8.5 and 6.25.
inline constexpr BlockCost kWgmmaBlockCost{4.6, 0.0};
inline constexpr BlockCost kWgmmaPairBlockCost{5.9, 0.0};
inline constexpr BlockCost kWgmmaDirectBlockCost{8.5, 0.0};
inline constexpr BlockCost kWgmmaDirectPairBlockCost{6.25, 0.0};
// kWgmmaPredecoded (the producer copies BF16 rows decoded once per launch into two K tiles),
// fitted to its prefill rows (H200, 2026-12-04, sparse_attention_bench --batches 128, one
// split; measured / model µs, the decode pass included): Flash CSA s_q 4096 902.9 / 894,
// s_q 8192 1822.5 / 1775; Pro CSA s_q 4096 2899.9 / 3036, s_q 8192 5773.7 / 6011 -> 2.5.
// At decode its pass decodes whole contexts (Flash CSA b=128 s_q 1 at 16K: 350.2 µs against
// the staged kernel's 57.7), which the pass term below charges.
inline constexpr BlockCost kWgmmaPredecodedBlockCost{2.5, 0.0};
// Measured at prefill only: decode launches (1-4 tokens a sequence) never take it, however the
// model compares (its pass would decode each sequence's whole context for a token or two).
inline constexpr int kPredecodeMinTokensPerSeq = 16;
// The decode pass: a launch, and each row's entry read (584 bytes) and BF16 row written.
inline constexpr double kPredecodeLaunchUs = 3.0;
inline constexpr double kKeyRowBytes = 512 * 2;
inline constexpr double kPredecodeBytesPerRow = 584 + kKeyRowBytes;
inline constexpr double kCombineLaunchUs = 2.0;
inline constexpr double kHbmBytesPerUs = 3.0e6;   // 3.0 TB/s
inline constexpr double kPartialBytes = 516 * 4;  // O[512], m, l, pad (fp32), per (token, head)
inline constexpr double kOutBytes = 512 * 2;      // BF16 output per (token, head)

}  // namespace dsv4::cuda::sparse_attn_heuristics
