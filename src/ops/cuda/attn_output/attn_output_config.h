// Tile geometry of the output-path kernels.
#pragma once

namespace dsv4::cuda::attn_output_cfg {

// Weight-streaming wo_a (small M): a CTA owns kWsRows weight rows of one group over the whole
// K; each warp computes 16 rows x (8 * n-tiles) tokens with mma.sync m16n8k16 (the weight is
// the 16-row A operand, the tokens the 8-column B operand). K advances in stages of kWsStageK
// through a kWsStages-deep cp.async ring (weights 16 KB + activations per stage).
constexpr int kWsWarps = 4;
constexpr int kWsRows = 16 * kWsWarps;
constexpr int kWsStageK = 256;
constexpr int kWsStages = 4;
// The CTA's weight block is prefetched into L2 by this many threads, one part each (K is a
// multiple of kWsStageK, so every part is a multiple of 16 bytes).
constexpr int kWsPrefetchParts = 16;
constexpr int kWsThreads = kWsWarps * 32;

// In-place inverse RoPE: one thread per (token, head, 8 RoPE dims).
constexpr int kRopeThreads = 256;

}  // namespace dsv4::cuda::attn_output_cfg
