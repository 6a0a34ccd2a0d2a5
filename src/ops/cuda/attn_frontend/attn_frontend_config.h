// Tile geometry of the attention front-end kernels. A 512-wide BF16 row (1 KB) is read by one
// warp as two 16-byte vectors per lane: lane l holds elements [8l, 8l+8) and [256+8l, 256+8l+8),
// so the RoPE pairs (448..511) sit in lanes 24..31 of the second vector and every 64-element
// FP8 block is one aligned group of 8 lanes.
#pragma once

namespace dsv4::cuda::attn_frontend_cfg {

// q_norm_rope: one CTA per (token, group of heads); each warp handles kQRowsPerWarp head rows
// at once (their loads in flight together).
constexpr int kQWarps = 8;
constexpr int kQRowsPerWarp = 2;
constexpr int kQHeadsPerCta = kQWarps * kQRowsPerWarp;

// kv kernels: one warp per token.
constexpr int kKvWarps = 4;

// rope_cos_sin: one thread per (token, pair).
constexpr int kRopeThreads = 256;

}  // namespace dsv4::cuda::attn_frontend_cfg
