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

// Prefill wo_a (CUTLASS, wo_a_cutlass.cu): CTA tiles of 128 weight rows x 128 or 256 tokens. The
// wider tile converts each FP8 weight tile once per 256 tokens (H200, attn_output_bench, us at
// 128 / 256: Flash M 512 75.5 / 62.5, M 4096 493 / 374, M 8192 1077 / 860; Pro M 256 72.3 /
// 63.8, M 512 135.7 / 106.5, M 8192 2152 / 1709) but makes half the tiles: it is taken when its
// waves (one CTA an SM) cost no more, ceil(tiles / sms) x width (Flash M 256: 128 tiles of 128
// tokens fill one wave, 47.8 us against 58.1 with 64 tiles of 256).
constexpr int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}
constexpr int wo_a_tile_tokens(int m, int o_lora, int groups, int sms) {
  const int row_tiles = ceil_div(o_lora, 128) * groups;
  const int narrow = ceil_div(row_tiles * ceil_div(m, 128), sms) * 128;
  const int wide = ceil_div(row_tiles * ceil_div(m, 256), sms) * 256;
  return wide <= narrow ? 256 : 128;
}
static_assert(wo_a_tile_tokens(256, 1024, 8, 132) == 128 &&
              wo_a_tile_tokens(512, 1024, 8, 132) == 256 &&
              wo_a_tile_tokens(8192, 1024, 8, 132) == 256 &&
              wo_a_tile_tokens(256, 1024, 16, 132) == 256);

// In-place inverse RoPE: one thread per (token, head, 8 RoPE dims).
constexpr int kRopeThreads = 256;

}  // namespace dsv4::cuda::attn_output_cfg
