// Tile geometry of the GEMM kernels (fp8_gemm.h, head/logits.h). Heuristics that pick among
// them live in fp8_gemm_heuristic.h.
#pragma once

namespace dsv4::cuda::gemm_cfg {

// Quantisation block along K: activations 1x128, weights 128x128 (the checkpoint's blocks).
constexpr int kQuantBlock = 128;

// ---- weight-streaming kernel (stream_gemm.cuh) -------------------------------------------
// One CTA: a consumer warpgroup and a TMA producer warp, 128 weight rows (two wgmma m64 tiles,
// one 128-row weight-scale block) x a range of K steps; one step = 128 bytes of K per row
// (128 e4m3 or 64 BF16 values), i.e. one 128B-swizzled shared-memory row.
constexpr int kStreamRows = 128;
constexpr int kStreamStepBytes = 128;
constexpr int kStreamThreads = 160;
constexpr int kStreamConsumerThreads = 128;
// Tokens are the wgmma N dimension: padded to 8, 16, 32 or 64.
constexpr int kStreamMaxTokens = 64;
// Above 64 tokens a launch runs blocks of 64 as separate CTAs, up to this many tokens.
constexpr int kStreamMaxM = 256;
// K is split over at most this many CTAs of one cluster: 16 is Hopper's non-portable cluster
// size (the launcher asks the device how many such clusters fit, fp8_gemm_heuristic.h), 8 the
// portable one that every sm_90 device places.
constexpr int kStreamMaxSplits = 16;
constexpr int kStreamPortableSplits = 8;
// Weight matrices one launch streams against the same activations (grouped GEMM).
constexpr int kStreamMaxGroups = 4;
// wgmma K slices (32 bytes of K each) issued back to back before one wait, per token width:
// each slice keeps its own accumulator (the exact per-slice promotion), so the batch costs
// 2 * kAcc registers per slice; 64 tokens keep one slice per wait.
constexpr int stream_slice_batch(int tokens) {
  return tokens <= 16 ? 4 : tokens <= 32 ? 2 : 1;
}
// Shared memory per CTA, so that two CTAs share an SM (228 KB per SM, 1 KB reserved per CTA).
constexpr int kStreamSmemBudget = 112 * 1024;
constexpr int kStreamMaxStages = 8;
constexpr int kStreamCtasPerSm = 2;

constexpr int stream_tokens(int m) {
  return m <= 8 ? 8 : m <= 16 ? 16 : m <= 32 ? 32 : 64;
}
constexpr int align_up(int x, int a) {
  return (x + a - 1) / a * a;
}
// Bytes of one pipeline stage: weight tile, activation tile, (fp8) activation scales.
constexpr int stream_stage_bytes(int tokens, bool fp8) {
  return kStreamRows * kStreamStepBytes + tokens * kStreamStepBytes +
         (fp8 ? align_up(tokens * 4, 128) : 0);
}
// Alignment slack (1 KB: swizzled tiles sit on 1 KB boundaries) + barriers.
constexpr int kStreamSmemFixed = 1024 + 256;
constexpr int stream_stages(int tokens, bool fp8) {
  const int s = (kStreamSmemBudget - kStreamSmemFixed) / stream_stage_bytes(tokens, fp8);
  return s > kStreamMaxStages ? kStreamMaxStages : s;
}
constexpr int stream_smem_bytes(int tokens, bool fp8) {
  return kStreamSmemFixed + stream_stages(tokens, fp8) * stream_stage_bytes(tokens, fp8);
}
static_assert(stream_stages(64, true) >= 2 && stream_stages(64, false) >= 2);
// The epilogue reuses the stage buffers for the 128 x tokens fp32 partial tile.
static_assert(stream_stages(64, true) * (kStreamRows * kStreamStepBytes) >= kStreamRows * 64 * 4);

// ---- prefill kernel (CUTLASS sm90 FP8 blockwise, fp8_gemm_prefill.cu) --------------------------
// Cooperative warp-specialised kernel, 128x128x128 tiles (two consumer warpgroups of 64 rows),
// persistent tile scheduler; a 1x2 cluster multicasts the activation tile to both CTAs.
constexpr int kPrefillTileM = 128;
constexpr int kPrefillTileN = 128;
constexpr int kPrefillTileK = 128;

}  // namespace dsv4::cuda::gemm_cfg
