// Tile geometry of the output-path kernels.
#pragma once

namespace dsv4::cuda::attn_output_cfg {

// Weight-streaming wo_a (small M): a CTA owns kWsRows weight rows of one group over the whole
// K; each row warp computes 16 rows x (8 * n-tiles) tokens with mma.sync m16n8k16 (the weight is
// the 16-row A operand, the tokens the 8-column B operand). K advances in stages of kWsStageK
// through a kWsStages-deep cp.async ring (weights 16 KB + activations per stage); each stage is
// kWsKSplit 128-wide K blocks, one per set of row warps, whose fp32 sums are added (set 0 + set
// 1) once at the end. Two sets: Flash's 128 CTAs (one an SM) ran 4 warps an SM and streamed
// 1.6 TB/s where Pro's 256 (two an SM, 8 warps) reached 2.6 (H200, attn_output_bench).
constexpr int kWsWarps = 4;  // row warps
constexpr int kWsRows = 16 * kWsWarps;
constexpr int kWsKSplit = 2;  // sets of row warps, one 128-wide K block of a stage each
constexpr int kWsStageK = 128 * kWsKSplit;
constexpr int kWsStages = 4;
// The CTA's weight block is prefetched into L2 by this many threads, one part each (K is a
// multiple of kWsStageK, so every part is a multiple of 16 bytes).
constexpr int kWsPrefetchParts = 16;
constexpr int kWsThreads = kWsWarps * kWsKSplit * 32;

// In-place inverse RoPE: one thread per (token, head, 8 RoPE dims).
constexpr int kRopeThreads = 256;

}  // namespace dsv4::cuda::attn_output_cfg
