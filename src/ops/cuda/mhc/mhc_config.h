// Geometry of the mHC kernels (mhc.cu): cluster slicing, warp roles, shared-memory layout.
#pragma once

#include <cstddef>

namespace dsv4::cuda::mhc_cfg {

constexpr int kHc = 4;       // streams (hc_mult); the kernels are written for 4
constexpr int kMixPre = 24;  // (2 + hc) * hc projection rows of hc_pre
constexpr int kMixHead = 4;  // hc rows of hc_head
constexpr int kComputeWarps = 8;
constexpr int kThreads = (kComputeWarps + 1) * 32;  // + one warp for Sinkhorn and bookkeeping
constexpr int kComputeThreads = kComputeWarps * 32;
constexpr int kMaxCluster = 16;  // non-portable cluster size (Hopper allows 16)
// Sinkhorn on 16 lanes per token (two tokens per warp pass) while a CTA owns at most this many
// tokens of a tile (decode); one lane per token beyond (prefill tiles own 3-6 per CTA).
constexpr int kLaneSinkhornMaxOwned = 4;

// Each CTA of a cluster owns a slice of `ds` dims (256 or 512) of every stream; each compute
// warp owns dw = ds / 8 dims (32 or 64), i.e. dw / 32 "sub-chunks" of 32 dims per stream.
// Resident streams per CTA: m_tiles x 16 tokens x hc x ds BF16 values, at most kXBudget bytes.
constexpr int kXBudget = 192 * 1024;
constexpr int max_mtiles(int dw) {
  return kXBudget / (kComputeWarps * 16 * kHc * dw * 2);
}
static_assert(max_mtiles(32) == 6 && max_mtiles(64) == 3);

// The dims slice a CTA owns for a model width, 0 when unsupported.
constexpr int slice_dims(int dim) {
  if (dim > 0 && dim % 256 == 0 && dim / 256 <= kMaxCluster) return 256;
  if (dim > 0 && dim % 512 == 0 && dim / 512 <= kMaxCluster) return 512;
  return 0;
}

// Widths the op takes at all: a multiple of 8 (16-byte vectors of BF16) up to kMaxDim. Those
// slice_dims() refuses run on the per-token kernel (mhc_token.h).
constexpr int kMaxDim = 16384;
constexpr bool supported_dim(int dim) {
  return dim > 0 && dim % 8 == 0 && dim <= kMaxDim;
}
constexpr bool uses_cluster_kernel(int dim) {
  return slice_dims(dim) != 0;
}

// Split-K path (mhc_split.h): a d-chunk is 32 dims of all 4 streams (128 values of the token's
// flattened streams); a projection CTA has one warp per stream and owns whole d-chunks; token
// tiles of 16 x kSplitMaxMt rows; the finishing kernel has one CTA per token, whose collapse
// threads (224: warp 0 runs Sinkhorn) hold at most kSplitMaxYChunks chunks of 8 dims of y each.
// kAuto runs it at every token count at the widths it takes (a multiple of 32 up to kSplitMaxDim:
// Flash 4096, Pro 7168): measured on the H200 it beats the cluster kernel at every count from 1 to
// 8192 (hc_pre + norm, Flash: 10.6 vs 15.4 us per call at 1 token in a chain of calls, 16.8 vs
// 27.1 at 128, 325 vs 780 us at 8192); the cluster and per-token kernels serve the other widths
// and HcPath::kCluster.
constexpr int kSplitDimUnit = 32;
// hc_post_pre on the split path fuses hc_post into the projection kernel up to this many tokens;
// past it the streaming hc_post kernel then the split hc_pre are faster (H200: the fused
// projection kernel's hc_post reads all 4 streams per warp with exposed latency; at 512 tokens,
// Flash, fused 55 us vs split hc_pre 29 us + hc_post ~13 us; at 128 they tie, 26 vs 20 + 6).
constexpr int kSplitFusedPostMaxTokens = 128;
constexpr int kSplitMaxDim = 8192;
constexpr int kSplitMaxMt = 4;
constexpr int kSplitProjThreads = kHc * 32;
constexpr int kSplitFinishThreads = 256;
constexpr int kSplitCollapseThreads = kSplitFinishThreads - 32;
constexpr int kSplitMaxYChunks =
    (kSplitMaxDim / 8 + kSplitCollapseThreads - 1) / kSplitCollapseThreads;
// The finisher sums the split partials in 10 fixed ranges (a thread per range and value).
constexpr int kSplitReduceParts = 10;
// Up to this many tokens (one CTA each: about a wave) the finishing kernel loads the streams and
// the norm weight early (mhc_split.cu, kEarly); beyond, where two CTAs an SM pay, where used.
// Beyond it the finish is the staged kernel and Sinkhorn runs apart, after it (two tokens a warp,
// hc_split_sinkhorn_kernel): in the finish, warp 0's 20 dependent iterations (~3 us a token, by
// count of the dependent operations, not measured) outlast the collapse and hold the CTA's slot.
constexpr int kSplitEarlyLoadMaxTokens = 256;
// From this many tokens the projection (kPre / kHead) stages the streams through shared memory,
// kSplitProjStages deep (cp.async): prefill, where the register kernel's one chunk in flight
// held it to ~1.6 TB/s. H200 (stop 42), Flash hc_pre + norm at 8192 tokens: 297 us (325), the
// projection 168 -> 141 us and the (staged) finishing kernel 231 -> 181 us in the 8K prefill.
constexpr int kSplitStagedMinTokens = 1024;
constexpr int kSplitProjStages = 4;
constexpr int kSplitMaxSplitsPerPart =
    (kSplitMaxDim / kSplitDimUnit + kSplitReduceParts - 1) / kSplitReduceParts;
static_assert(kSplitMaxYChunks == 5 && kSplitReduceParts * (kMixPre + 1) <= kSplitFinishThreads &&
              kSplitMaxSplitsPerPart == 26);
constexpr bool split_supports_dim(int dim) {
  return dim > 0 && dim % kSplitDimUnit == 0 && dim <= kSplitMaxDim;
}
constexpr bool uses_split_kernel(int dim, int tokens) {
  return split_supports_dim(dim) && tokens >= 1;
}
// Token rows per projection tile: 16, 32 or 64 (fn is re-read from L2 once per tile).
constexpr int split_mtiles(int tokens) {
  return tokens <= 16 ? 1 : tokens <= 32 ? 2 : kSplitMaxMt;
}
// The staged projection is instantiated for the largest tiles only.
static_assert(split_mtiles(kSplitStagedMinTokens) == kSplitMaxMt);

// Per-token kernel: threads per CTA (one per chunk of 8 of the token's 4*dim values, whole warps,
// at most kTokenMaxThreads). A function of dim only, so the reduction order is fixed per width.
constexpr int kTokenMaxThreads = 256;
constexpr int token_threads(int dim) {
  const int chunks = kHc * dim / 8;
  const int t = (chunks + 31) / 32 * 32;
  return t < 32 ? 32 : t > kTokenMaxThreads ? kTokenMaxThreads : t;
}
static_assert(token_threads(128) == 64 && token_threads(384) == 192 && token_threads(8) == 32 &&
              token_threads(8192) == 256);

// Shared-memory layout for `m_tiles` token tiles of 16 and warp width dw (bytes, 16-aligned).
struct SmemLayout {
  size_t x = 0;         // resident streams, per warp: m_tiles * 16 * hc * dw BF16
  size_t red = 0;       // cross-warp reduction of the projection (8 x 16 x 24 fp32); later
                        // the owned tokens' mixes (fp32) and sums of squares (fp64)
  size_t red_ss = 0;    // cross-warp sums of squares (8 x tokens fp64); later fp32 norm factors
  size_t part_mix = 0;  // this CTA's partial projection [tokens, 24] fp32 (read by the
                        // cluster); before that, post/comb of hc_post_pre [tokens, 20]
  size_t part_ss = 0;   // this CTA's partial sum of squares [tokens] fp64 (streams, then y)
  size_t own_pre = 0;   // pre weights of the tokens this CTA owns [tokens, 4]
  size_t pre_all = 0;   // pre weights of every token of the tile [tokens, 4]
  size_t total = 0;
};
constexpr size_t kRedBytes = size_t(kComputeWarps) * 16 * kMixPre * 4;
constexpr size_t kOwnSsOffset = 10240;  // inside `red`: after <= 96 x 25 fp32 owned mixes
static_assert(96 * (kMixPre + 1) * 4 <= kOwnSsOffset && kOwnSsOffset + 96 * 8 <= kRedBytes);

constexpr SmemLayout smem_layout(int m_tiles, int dw) {
  SmemLayout l;
  const size_t tokens = size_t(m_tiles) * 16;
  size_t off = 0;
  l.x = off;
  off += size_t(m_tiles) * kComputeWarps * 16 * kHc * dw * 2;
  l.red = off;
  off += kRedBytes;
  l.red_ss = off;
  off += kComputeWarps * tokens * 8;
  l.part_mix = off;
  off += tokens * kMixPre * 4;
  l.part_ss = off;
  off += tokens * 8;
  l.own_pre = off;
  off += tokens * kHc * 4;
  l.pre_all = off;
  off += tokens * kHc * 4;
  l.total = off;
  return l;
}
static_assert(smem_layout(6, 32).total <= 227 * 1024 && smem_layout(3, 64).total <= 227 * 1024);

}  // namespace dsv4::cuda::mhc_cfg
