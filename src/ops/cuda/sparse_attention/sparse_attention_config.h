// Tile geometry of the sparse-attention kernels.
#pragma once

namespace dsv4::cuda::sparse_attn_cfg {

constexpr int kHeadDim = 512;
constexpr int kNopeDim = 448;
constexpr int kRopeDim = 64;
constexpr int kQuantBlock = 64;
constexpr int kEntryData = 576;  // 448 e4m3 + 64 BF16
constexpr int kEntryScales = 8;  // 7 UE8M0 + pad
constexpr int kKeyBlock = 64;    // keys per softmax block (cpu::kAttnKeyBlock)
constexpr int kMaxWindow = 4096;
constexpr int kMaxTopk = 1024;

// mma.sync kernel: 8 warps; a CTA owns HT heads (16, 32 or 64) of one query token. Warps form
// HT/16 head groups x (8 / (HT/16)) dim groups: a warp computes the scores of its 16 heads for
// 64/DG keys of the block (all 512 dims), and P.V of its 16 heads for 512/DG output dims.
template <int HT>
struct MmaCfg {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kHeadGroups = HT / 16;
  static constexpr int kDimGroups = kWarps / kHeadGroups;
  static constexpr int kDimsPerWarp = kHeadDim / kDimGroups;     // 256, 128, 64
  static constexpr int kKeysPerWarp = kKeyBlock / kDimGroups;    // 32, 16, 8
  static constexpr int kRawStages = HT == 64 ? 2 : 3;            // FP8 blocks in flight
  static constexpr int kRow = kHeadDim + 8;                      // BF16 per smem row (ldmatrix)
  static constexpr int kRawRow = kEntryData + kEntryScales + 8;  // 592 B, 16-byte multiple
  static constexpr int kSRow = kKeyBlock + 4;                    // fp32 per score row
};

// wgmma kernel (n_heads a multiple of 64): a CTA owns 64 heads of one query token; three
// warpgroups (WG0: S + softmax + P.V dims 0-255, WG1: P.V dims 256-511, WG2: producer) with
// registers rebalanced by setmaxnreg (128 x (240 + 168 + 96) <= 64K). The K tiles and the
// producer's raw stages per variant: WgLayout in sparse_attention_wgmma.cu.
struct WgmmaCfg {
  static constexpr int kHeads = 64;
  static constexpr int kThreads = 384;
  static constexpr int kTileBytes = 8 * 64 * 128;  // 64 rows x 512 BF16, eight swizzled regions
  static constexpr int kRegsWg0 = 240, kRegsWg1 = 168, kRegsProducer = 96;
};

// The combine (sparse_attention_combine.cu): a CTA of kCombineWarps warps a (token, head) row,
// each warp 128 of the 512 value dims; the partials of kCombineGroup splits loaded together.
constexpr int kCombineWarps = 4;
constexpr int kCombineGroup = 16;

}  // namespace dsv4::cuda::sparse_attn_cfg
