// Sparse attention, Hopper kernel for head tiles of 64 (n_heads a multiple of 64: V4-Flash 64,
// V4-Pro 128): one CTA per (query token, 64 heads, key split), three warpgroups —
//   WG2 (producer): brings each 64-key block's 584-byte entries (window ring / staged batch
//       entries / compressed store) on chip, decodes e4m3 x UE8M0 to BF16 exactly with integer
//       bit moves and one BF16 multiply per pair, and writes the 128-byte-swizzled K tile;
//   WG0: S = Q K^T (wgmma 64x64x16, Q and K from smem), the block's online softmax exactly as
//       cpu::sparse_attention (running max, P rounded to BF16 against it, sum of the unrounded
//       exponentials), P to smem for WG1, and O[:, 0:256] += P V (wgmma 64x256x16, P from
//       registers, V = the same K tile read MN-major);
//   WG1: O[:, 256:512] += P V (P from smem).
// Three producers (the template parameter kP, WgProducer):
//   staged (the default): the raw entries are copied asynchronously into a ring of raw FP8
//       stages in shared memory — one thread per key issues a 576-byte bulk copy (the copy
//       engine, no registers held) and an 8-byte cp.async of its scales, both completing on the
//       stage's mbarrier — two blocks ahead of the decode (four stages of half blocks for a CTA
//       pair), so the gather's HBM latency overlaps two blocks of MMAs. The decode then runs
//       shared -> shared into one BF16 K tile (the raw ring takes the second tile's room: 64 KB
//       Q + 64 KB K + 74 KB raw), conflict-free (a warp reads 32 consecutive raw rows of 592
//       bytes and writes 32 swizzled rows). Its key lookups (top-k entry -> page id) run one
//       issue ahead of the copies.
//   direct (the previous kernel, kept for the side-by-side benchmark): each producer thread
//       loads its share of the entries straight into registers (16-byte loads whose lines are
//       evicted first from L2, an L2 bulk prefetch two blocks ahead, top-k entries four blocks
//       ahead, pages three) into two BF16 K tiles; a block's decode waits for its loads.
//   predecoded (SparseAttnKernel::kWgmmaPredecoded, prefill): the keys were decoded to BF16
//       rows once per launch (sparse_attention_predecode.cu); the producer only copies its
//       block's rows into the swizzled K tile with cp.async (16-byte chunks, eight lanes per
//       128 contiguous bytes of a row; zero fill for invalid slots), two K tiles, one block
//       ahead of the consumers. Same tiles as the staged decode, so the same output bits.
// All hand the K tiles to the consumers through mbarriers. With head tiles in pairs (n_heads a
// multiple of 128) the two CTAs of a token's pair run as a cluster and split each block's
// gather and decode: each brings in and decodes 32 keys and writes the rows into both CTAs' K
// tiles (distributed shared memory), so every key is read and decoded once per token instead
// of once per 64 heads.
// Splits write unnormalised partials for sparse_attention_combine.cu; one split applies the
// sink and writes BF16 directly.
#include <cuda_bf16.h>

#include <cmath>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/sparse_attention/sparse_attention_internal.h"

#if defined(DSV4_HAVE_CUTLASS)

#include "ops/cuda/common/sm90/bf16x2.cuh"
#include "ops/cuda/common/sm90/cp_async.cuh"
#include "ops/cuda/common/sm90/gmem.cuh"
#include "ops/cuda/common/sm90/mbarrier.cuh"
#include "ops/cuda/common/sm90/smem.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/common/sm90/tma.cuh"
#include "ops/cuda/common/sm90/wgmma.cuh"
#include "ops/cuda/sparse_attention/decode.cuh"
#include "ops/cuda/sparse_attention/key_source.cuh"
#include "ops/cuda/sparse_attention/sparse_attention_config.h"

namespace dsv4::cuda::sparse_attn_detail {
namespace {

using namespace sparse_attn_cfg;
using namespace detail;
using C = WgmmaCfg;

// Buffers of one producer variant (kCluster CTAs per token, staged or direct producer).
template <int kCluster, WgProducer kP>
struct WgLayout {
  static constexpr bool kStaged = kP == WgProducer::kStaged;
  static constexpr int kKBufs = kStaged ? 1 : 2;         // BF16 K tiles
  static constexpr int kRawKeys = kKeyBlock / kCluster;  // this CTA's keys of a block
  // Raw stages in flight: two blocks (a CTA pair's stages hold half blocks: four).
  static constexpr int kRawStages = kStaged ? 2 * kCluster : 0;
  static constexpr int kRawRow = kEntryData + 16;  // 576 data + 8 scales + pad: 592 B
  static constexpr int kRawBytes = kRawStages * kRawKeys * kRawRow;
};

template <int kCluster, WgProducer kP>
struct alignas(1024) WgSmem {
  using L = WgLayout<kCluster, kP>;
  uint8_t q[C::kTileBytes];
  uint8_t k[L::kKBufs][C::kTileBytes];
  uint8_t p[sm90::kSw128RegionBytes];
  uint8_t raw[L::kRawBytes > 0 ? L::kRawBytes : 16];  // [stage][key][kRawRow]
  float alpha[C::kHeads];
  float fin[C::kHeads];
  uint32_t valid[L::kKBufs][kKeyBlock];
  uint32_t raw_valid[L::kRawStages > 0 ? L::kRawStages : 1][L::kRawKeys];
  uint64_t full[L::kKBufs];   // K tile b written (by both CTAs of a pair)
  uint64_t empty[L::kKBufs];  // K tile b read by every consumer warp (of both CTAs of a pair)
  uint64_t raw_full[L::kRawStages > 0 ? L::kRawStages : 1];  // raw stage's copies landed
};
static_assert(sizeof(WgSmem<1, WgProducer::kStaged>) + 1024 <= 227 * 1024, "staged layout fits");
static_assert(sizeof(WgSmem<2, WgProducer::kStaged>) + 1024 <= 227 * 1024,
              "staged pair layout fits");
static_assert(sizeof(WgSmem<1, WgProducer::kDirect>) + 1024 <= 227 * 1024, "direct layout fits");
static_assert(sizeof(WgSmem<1, WgProducer::kPredecoded>) + 1024 <= 227 * 1024,
              "predecoded layout fits");

// Named barrier ids (the P hand-off between the consumer warpgroups of one CTA; the staged
// producer's raw stage read by all of its threads; each consumer warpgroup's output rows).
enum : int { kBarPReady = 5, kBarPFree = 6, kBarEpi = 7, kBarRawFree = 8, kBarOut0 = 9 };  // 9, 10
constexpr int kPair = 256;

// The producer's share of the K tile. kCluster = 1: 64 keys, 2 threads per key, four 64-dim
// regions each. kCluster = 2 (a CTA pair over the same token, 64 heads each): 32 keys per CTA,
// 4 threads per key, two regions each, every row written into both CTAs' tiles.
template <int kCluster>
struct ProducerSplit {
  static constexpr int kThreadsPerKey = 2 * kCluster;
  static constexpr int kKeysPerCta = kKeyBlock / kCluster;
  static constexpr int kRegions = 8 / kThreadsPerKey;  // 64-dim regions per thread
  static constexpr int kPasses = kRegions / 2;         // two regions per pass (8 x 16 B loads)
  static_assert(C::kThreads / 3 == kKeysPerCta * kThreadsPerKey, "one warpgroup covers the share");
};

// Writes 16 bytes at tile offset `off` into this CTA's tile and, for a pair, the peer's.
template <int kCluster>
__device__ __forceinline__ void put16(uint8_t* tile, uint32_t peer_tile, uint32_t off, uint4 v) {
  *reinterpret_cast<uint4*>(tile + off) = v;
  if constexpr (kCluster == 2) sm90::st_cluster_16(peer_tile + off, v);
}

// One pass of the producer: regions r0, r0 + 1 of key row `key` (region 7 = the RoPE dims,
// already BF16), decoded exactly from the entry at `src` (nullptr: an invalid slot, zeros).
template <int kCluster>
__device__ __forceinline__ void produce_pass(uint8_t* tile, uint32_t peer_tile, int key, int r0,
                                             const uint8_t* src, uint64_t scales, uint64_t pol) {
  if (src == nullptr) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int ch = 0; ch < 8; ++ch)
        put16<kCluster>(tile, peer_tile, sm90::sw128_bf16_offset(key, 64 * (r0 + r) + 8 * ch),
                        make_uint4(0, 0, 0, 0));
    return;
  }
  if (r0 == 6) {  // region 6 (NoPE 384-447) and region 7 (RoPE)
    uint4 w[4], rope[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = sm90::ld_nc_16(src + 384 + 16 * i, pol);
#pragma unroll
    for (int i = 0; i < 8; ++i) rope[i] = sm90::ld_nc_16(src + kNopeDim + 16 * i, pol);
    const uint32_t s2 = bf16x2_pow2(int((scales >> 48) & 0xff) - 7);  // scale of block 6
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint4 lo, hi;
      e4m3x4_to_bf16x4(w[i].x, s2, lo.x, lo.y);
      e4m3x4_to_bf16x4(w[i].y, s2, lo.z, lo.w);
      e4m3x4_to_bf16x4(w[i].z, s2, hi.x, hi.y);
      e4m3x4_to_bf16x4(w[i].w, s2, hi.z, hi.w);
      put16<kCluster>(tile, peer_tile, sm90::sw128_bf16_offset(key, 384 + 16 * i), lo);
      put16<kCluster>(tile, peer_tile, sm90::sw128_bf16_offset(key, 384 + 16 * i + 8), hi);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
      put16<kCluster>(tile, peer_tile, sm90::sw128_bf16_offset(key, kNopeDim + 8 * i), rope[i]);
  } else {
    uint4 w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = sm90::ld_nc_16(src + 64 * r0 + 16 * i, pol);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int blk = r0 + (i >> 2);  // 64-value scale block = region
      const uint32_t s2 = bf16x2_pow2(int((scales >> (8 * blk)) & 0xff) - 7);
      const int d = 64 * r0 + 16 * i;
      uint4 lo, hi;
      e4m3x4_to_bf16x4(w[i].x, s2, lo.x, lo.y);
      e4m3x4_to_bf16x4(w[i].y, s2, lo.z, lo.w);
      e4m3x4_to_bf16x4(w[i].z, s2, hi.x, hi.y);
      e4m3x4_to_bf16x4(w[i].w, s2, hi.z, hi.w);
      put16<kCluster>(tile, peer_tile, sm90::sw128_bf16_offset(key, d), lo);
      put16<kCluster>(tile, peer_tile, sm90::sw128_bf16_offset(key, d + 8), hi);
    }
  }
}

// The staged producer's decode of region r (64 dims; region 7 = the RoPE dims, already BF16) of
// key row `key` from its raw row in shared memory (`valid` false: zeros).
template <int kCluster>
__device__ __forceinline__ void decode_region(uint8_t* tile, uint32_t peer_tile, int key, int r,
                                              const uint8_t* row, bool valid, uint64_t scales) {
  if (!valid) {
#pragma unroll
    for (int ch = 0; ch < 8; ++ch)
      put16<kCluster>(tile, peer_tile, sm90::sw128_bf16_offset(key, 64 * r + 8 * ch),
                      make_uint4(0, 0, 0, 0));
    return;
  }
  if (r == 7) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      put16<kCluster>(tile, peer_tile, sm90::sw128_bf16_offset(key, kNopeDim + 8 * i),
                      *reinterpret_cast<const uint4*>(row + kNopeDim + 16 * i));
    return;
  }
  uint4 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = *reinterpret_cast<const uint4*>(row + 64 * r + 16 * i);
  const uint32_t s2 = bf16x2_pow2(int((scales >> (8 * r)) & 0xff) - 7);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint4 lo, hi;
    e4m3x4_to_bf16x4(w[i].x, s2, lo.x, lo.y);
    e4m3x4_to_bf16x4(w[i].y, s2, lo.z, lo.w);
    e4m3x4_to_bf16x4(w[i].z, s2, hi.x, hi.y);
    e4m3x4_to_bf16x4(w[i].w, s2, hi.z, hi.w);
    put16<kCluster>(tile, peer_tile, sm90::sw128_bf16_offset(key, 64 * r + 16 * i), lo);
    put16<kCluster>(tile, peer_tile, sm90::sw128_bf16_offset(key, 64 * r + 16 * i + 8), hi);
  }
}

template <int kCluster, WgProducer kP>
__global__ void __launch_bounds__(C::kThreads, 1) sparse_attn_wgmma_kernel(const AttnArgs a) {
  static_assert(kP != WgProducer::kPredecoded || kCluster == 1, "predecoded rows: no pairs");
  using PS = ProducerSplit<kCluster>;
  using L = WgLayout<kCluster, kP>;
  using Smem = WgSmem<kCluster, kP>;
  constexpr bool kStaged = L::kStaged;
  constexpr int kKBufs = L::kKBufs;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Smem& sm =
      *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  // Launched programmatically (a.pdl): nothing is read before the kernel before is complete.
  // The combine (a programmatic dependent) may launch once every CTA has started; it still
  // waits for this grid to complete before reading the partials.
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int t = blockIdx.x / a.head_tiles;
  const int h0 = (blockIdx.x % a.head_tiles) * C::kHeads;
  const int split = blockIdx.y;
  const int tid = threadIdx.x, wgi = tid / 128, wt = tid % 128, lane = tid & 31;
  const int blk_begin = split * a.blocks_per_split;
  // Pair geometry: the peer is the other head tile of the same token (head_tiles is even).
  const uint32_t rank = kCluster == 2 ? sm90::cluster_ctarank() : 0u;
  const uint32_t peer = rank ^ 1u;
  // The staged producer's first top-k entries (blocks 0 .. R + 1 of the split; see below),
  // requested before the query's sequence and position, which they do not need.
  constexpr int kPrologue = L::kRawStages + 2;
  int tk[kPrologue];
#pragma unroll
  for (int j = 0; j < kPrologue; ++j)
    tk[j] = kStaged && wgi == 2 && wt < L::kRawKeys
                ? key_topk_entry(a, t, (blk_begin + j) * kKeyBlock + int(rank) * L::kRawKeys + wt)
                : 0;
  const QueryInfo qi = query_info(a, t);
  const int nblk = (qi.nkeys + kKeyBlock - 1) / kKeyBlock;
  const int blk_end = min(nblk, blk_begin + a.blocks_per_split);
  const int nb = blk_end - blk_begin;

  if (nb <= 0) {  // an empty split (the same for both CTAs of a pair): m = -inf for the combine
    if (tid < C::kHeads) {
      float* part = a.partials +
                    ((int64_t(t) * a.n_heads + h0 + tid) * a.num_splits + split) * kPartialFloats;
      part[kHeadDim] = -INFINITY;
      part[kHeadDim + 1] = 0.0f;
    }
    return;
  }

  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < kKBufs; ++b) {
      sm90::mbar_init(&sm.full[b], kCluster * 128);  // every producer thread of the pair
      sm90::mbar_init(&sm.empty[b], kCluster * 8);   // every consumer warp of the pair
    }
#pragma unroll
    for (int st = 0; st < L::kRawStages; ++st)  // two arrivals per key: copies issued, scales
      sm90::mbar_init(&sm.raw_full[st], 2 * L::kRawKeys);
    sm90::fence_barrier_init();
  }
  if constexpr (kCluster == 2)
    sm90::cluster_sync();  // the peer's barriers are initialised before anyone arrives on them
  else
    __syncthreads();

  // Barrier arrivals: this CTA's, and for a pair the peer's copy as well.
  auto arrive_both = [&](uint64_t* bar) {
    if constexpr (kCluster == 2) {
      const uint32_t addr = sm90::smem_u32(bar);
      sm90::mbar_arrive_cluster(sm90::map_to_rank(addr, rank));
      sm90::mbar_arrive_cluster(sm90::map_to_rank(addr, peer));
    } else {
      sm90::mbar_arrive(bar);
    }
  };
  auto wait = [&](uint64_t* bar, uint32_t parity) {
    if constexpr (kCluster == 2)
      sm90::mbar_wait_cluster(bar, parity);
    else
      sm90::mbar_wait(bar, parity);
  };

  if (wgi == 2) {
    // ---------------------------------------------------------------- producer
    sm90::warpgroup_reg_dealloc<C::kRegsProducer>();
    // Q tile: thread -> head row wt / 2, half of the dims; cp.async, so the key lookups below
    // start at once (waited for before the first K tile is handed over).
    {
      const int row = wt >> 1, half = wt & 1;
      const __nv_bfloat16* src = a.q + (int64_t(t) * a.n_heads + h0 + row) * kHeadDim + 256 * half;
#pragma unroll 8
      for (int i = 0; i < 32; ++i)
        sm90::cp_async_16(sm.q + sm90::sw128_bf16_offset(row, 256 * half + 8 * i), src + 8 * i);
      sm90::cp_async_commit();
    }
    const uint64_t pol = sm90::l2_policy_evict_first();  // keys are read once per token
    if constexpr (kP == WgProducer::kPredecoded) {
      // Warp w4 copies keys 16 w4 .. 16 w4 + 15 of each block, four at a time: lane l brings
      // chunk l % 8 (16 bytes) of every 64-dim region of key 4 g + l / 8, so each copy
      // instruction reads 128 contiguous bytes of four rows. A thread's four top-k entries of
      // block i + 1 are loaded while block i's copies are in flight.
      const int w4 = wt >> 5, sub = lane >> 3, ch = lane & 7;
      auto slot_of = [&](int i, int g) {
        return (blk_begin + i) * kKeyBlock + 16 * w4 + 4 * g + sub;
      };
      auto issue = [&](int i, const int(&tke)[4]) {
        const int b = i % kKBufs;
        const uint32_t tile = sm90::smem_u32(sm.k[b]);
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          const int key = 16 * w4 + 4 * g + sub;
          const int64_t row = key_row(a, qi, slot_of(i, g), tke[g]);
          const __nv_bfloat16* src = a.keys_bf16 + (row >= 0 ? row * kHeadDim : 0) + 8 * ch;
          const int bytes = row >= 0 ? 16 : 0;  // invalid: zeros (P V reads the row)
#pragma unroll
          for (int r = 0; r < 8; ++r)
            sm90::cp_async_16_zfill(tile + sm90::sw128_bf16_offset(key, 64 * r + 8 * ch),
                                    src + 64 * r, bytes);
          if (ch == 0) sm.valid[b][key] = row >= 0 ? 1u : 0u;
        }
        sm90::cp_async_commit();
      };
      int tk_now[4], tk_next[4];
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        tk_now[g] = key_topk_entry(a, t, slot_of(0, g));
        tk_next[g] = nb > 1 ? key_topk_entry(a, t, slot_of(1, g)) : 0;
      }
      issue(0, tk_now);
#pragma unroll 1
      for (int i = 0; i < nb; ++i) {
        // Block i's rows (and, at i = 0, this thread's part of the Q tile) have landed: hand the
        // tile over, then bring block i + 1 into the other tile once block i - 1 has left it.
        sm90::cp_async_wait<0>();
        sm90::fence_proxy_async_smem();
        sm90::mbar_arrive(&sm.full[i % kKBufs]);
        const int n = i + 1;
        if (n < nb) {
          if (n >= kKBufs) wait(&sm.empty[n % kKBufs], uint32_t(n / kKBufs + 1) & 1u);
          issue(n, tk_next);
#pragma unroll
          for (int g = 0; g < 4; ++g)
            tk_next[g] = n + 1 < nb ? key_topk_entry(a, t, slot_of(n + 1, g)) : 0;
        }
      }
    } else if constexpr (kStaged) {
      constexpr int R = L::kRawStages, kRawKeys = L::kRawKeys, kRawRow = L::kRawRow;
      constexpr int kParts = 128 / kRawKeys;   // decode threads per key: 2, a pair's 4
      constexpr int kRegionsPer = 8 / kParts;  // 64-dim regions per decode thread
      // Copies: thread wt < kRawKeys issues key slot rank * kRawKeys + wt of every block: an
      // expect_tx arrival and the 576 data bytes by the bulk copy engine, the 8 scale bytes by
      // cp.async with its completion as the second arrival (an invalid slot: two plain ones).
      const bool issuer = wt < kRawKeys;
      auto slot_of = [&](int i) { return (blk_begin + i) * kKeyBlock + int(rank) * kRawKeys + wt; };
      auto issue = [&](int blk, const KeyLoc& loc) {
        const int st = blk % R;
        uint8_t* dst = sm.raw + (st * kRawKeys + wt) * kRawRow;
        uint64_t* bar = &sm.raw_full[st];
        const KeyAddr src = key_address(a, loc);
        sm.raw_valid[st][wt] = src.data != nullptr ? 1u : 0u;
        if (src.data != nullptr) {
          sm90::mbar_arrive_expect_tx(bar, kEntryData);
          sm90::bulk_load(dst, src.data, kEntryData, bar, pol);
          sm90::cp_async_8(dst + kEntryData, src.scales);
          sm90::cp_async_mbar_arrive_noinc(bar);
        } else {
          sm90::mbar_arrive(bar);
          sm90::mbar_arrive(bar);
        }
      };
      // Prologue: the top-k entries of blocks 0 .. R + 1 (tk, loaded at the start), then their
      // pages, then the copies of blocks 0 .. R - 1; block R's page and block R + 1's entry stay
      // in flight.
      KeyLoc next_loc;
      int next_topk = 0;
      if (issuer) {
        KeyLoc lc[R + 1];
#pragma unroll
        for (int j = 0; j < R + 1; ++j)
          if (j < nb) lc[j] = key_locate(a, qi, slot_of(j), tk[j]);
#pragma unroll
        for (int j = 0; j < R; ++j)
          if (j < nb) issue(j, lc[j]);
        next_loc = lc[R];
        next_topk = tk[R + 1];
      }
      // Decode: thread -> key row dkey of this CTA's share, regions kRegionsPer * dpart ..; a
      // warp covers 32 consecutive rows of one part (conflict-free raw reads and tile writes).
      const int dkey = wt % kRawKeys, dpart = wt / kRawKeys;
      const int key = int(rank) * kRawKeys + dkey;
#pragma unroll 1
      for (int i = 0; i < nb; ++i) {
        const int st = i % R, b = i % kKBufs;
        sm90::mbar_wait(&sm.raw_full[st], uint32_t(i / R) & 1u);
        if (i >= kKBufs) wait(&sm.empty[b], uint32_t(i / kKBufs + 1) & 1u);  // tile consumed
        const uint32_t peer_k =
            kCluster == 2 ? sm90::map_to_rank(sm90::smem_u32(sm.k[b]), peer) : 0u;
        const uint8_t* row = sm.raw + (st * kRawKeys + dkey) * kRawRow;
        const bool valid = sm.raw_valid[st][dkey] != 0;
        const uint2 sc = *reinterpret_cast<const uint2*>(row + kEntryData);
        const uint64_t scales = (uint64_t(sc.y) << 32) | sc.x;  // byte j: UE8M0 of block j
#pragma unroll 1  // one region's registers at a time (the producer runs on 96)
        for (int r = 0; r < kRegionsPer; ++r)
          decode_region<kCluster>(sm.k[b], peer_k, key, kRegionsPer * dpart + r, row, valid,
                                  scales);
        if (dpart == 0) {
          const uint32_t v = valid ? 1u : 0u;
          sm.valid[b][key] = v;
          if constexpr (kCluster == 2)
            sm90::st_cluster_4(sm90::map_to_rank(sm90::smem_u32(&sm.valid[b][key]), peer), v);
        }
        if (i == 0) sm90::cp_async_wait<0>();  // this thread's part of the Q tile
        if constexpr (kCluster == 2)
          sm90::fence_proxy_async_smem_cluster();
        else
          sm90::fence_proxy_async_smem();
        arrive_both(&sm.full[b]);
        // Every producer thread is done with raw stage st: refill it with block i + R, and move
        // the lookups one block on (block i + R + 1's page, block i + R + 2's entry).
        sm90::named_barrier_sync(kBarRawFree, 128);
        if (issuer && i + R < nb) {
          issue(i + R, next_loc);
          if (i + R + 1 < nb) next_loc = key_locate(a, qi, slot_of(i + R + 1), next_topk);
          if (i + R + 2 < nb) next_topk = key_topk_entry(a, qi, slot_of(i + R + 2));
        }
      }
    } else {
      const int part = wt % PS::kThreadsPerKey;
      const int key = int(rank) * PS::kKeysPerCta + wt / PS::kThreadsPerKey;
      const int reg0 = part * PS::kRegions;
      // This thread's bytes of an entry: its regions, the RoPE tail with region 7.
      const int pf_lo = 64 * reg0;
      const int pf_hi = reg0 + PS::kRegions == 8 ? kEntryData : 64 * (reg0 + PS::kRegions);
      auto slot_of = [&](int i) { return (blk_begin + i) * kKeyBlock + key; };
      // The gather pipeline of this thread's key slot: iteration i loads the top-k entry of
      // block i + 4, the page of block i + 3, prefetches block i + 2 into L2, and decodes block i
      // (whose bytes were prefetched two iterations ago) once its K tile is free.
      int topk3 = 0;       // block i + 3's top-k entry (loaded last iteration)
      KeyLoc loc2;         // block i + 2's location and page (page loaded last iteration)
      KeyAddr src1, src0;  // blocks i + 1 and i (prefetched)
#pragma unroll 1
      for (int i = -4; i < nb; ++i) {
        const int topk4 = i + 4 < nb ? key_topk_entry(a, qi, slot_of(i + 4)) : 0;
        KeyLoc loc3;
        if (i + 3 >= 0 && i + 3 < nb) loc3 = key_locate(a, qi, slot_of(i + 3), topk3);
        KeyAddr src2;
        if (i + 2 >= 0 && i + 2 < nb) {
          src2 = key_address(a, loc2);
          if (src2.data != nullptr) {
            sm90::prefetch_l2_bulk(src2.data + pf_lo, uint32_t(pf_hi - pf_lo));
            if (part == 0) sm90::prefetch_l2(src2.scales);
          }
        }
        if (i >= 0) {
          const int b = i & 1;
          if (i >= kKBufs) wait(&sm.empty[b], ((i >> 1) + 1) & 1);  // block i - 2 consumed
          const uint32_t peer_k =
              kCluster == 2 ? sm90::map_to_rank(sm90::smem_u32(sm.k[b]), peer) : 0u;
          uint64_t scales = 0;  // byte j = UE8M0 of NoPE block j
          if (src0.data != nullptr) {
            const uint2 sc = sm90::ld_nc_8(src0.scales, pol);
            scales = (uint64_t(sc.y) << 32) | sc.x;
          }
#pragma unroll
          for (int ps = 0; ps < PS::kPasses; ++ps)
            produce_pass<kCluster>(sm.k[b], peer_k, key, reg0 + 2 * ps, src0.data, scales, pol);
          if (part == 0) {
            const uint32_t v = src0.data != nullptr ? 1u : 0u;
            sm.valid[b][key] = v;
            if constexpr (kCluster == 2)
              sm90::st_cluster_4(sm90::map_to_rank(sm90::smem_u32(&sm.valid[b][key]), peer), v);
          }
          if (i == 0) sm90::cp_async_wait<0>();  // this thread's part of the Q tile
          if constexpr (kCluster == 2)
            sm90::fence_proxy_async_smem_cluster();
          else
            sm90::fence_proxy_async_smem();
          arrive_both(&sm.full[b]);
        }
        src0 = src1;
        src1 = src2;
        loc2 = loc3;
        topk3 = topk4;
      }
    }
  } else {
    const int w4 = (tid >> 5) & 3, g = lane >> 2, c = lane & 3;
    const int r0 = 16 * w4 + g;  // this thread's rows r0, r0 + 8 (heads h0 + row)
    const uint32_t q_addr = sm90::smem_u32(sm.q), p_addr = sm90::smem_u32(sm.p);
    // A consumer warp is done with K tile b: one arrival per warp (its wgmmas have completed).
    auto release = [&](int b) {
      __syncwarp();
      if (lane == 0) arrive_both(&sm.empty[b]);
    };
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;

    if (wgi == 0) {
      // ---------------------------------------------------------------- S, softmax, P V (0-255)
      sm90::warpgroup_reg_alloc<C::kRegsWg0>();
      float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
      for (int i = 0; i < nb; ++i) {
        const int b = i % kKBufs;
        const uint32_t k_addr = sm90::smem_u32(sm.k[b]);
        wait(&sm.full[b], uint32_t(i / kKBufs) & 1u);
        sm90::fence_proxy_async_smem();
        float s[32];
        sm90::warpgroup_fence_operands(s);
        sm90::warpgroup_arrive();
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks)
          sm90::Bf16MmaSS<64>::wgmma(sm90::desc_region_kmajor(q_addr, ks),
                                     sm90::desc_region_kmajor(k_addr, ks), s, ks > 0);
        sm90::warpgroup_commit_batch();
        sm90::warpgroup_wait<0>();
        sm90::warpgroup_fence_operands(s);

        // Scores of keys 8j + 2c + e, rows r0 (s[4j + e]) and r0 + 8 (s[4j + 2 + e]).
        float bmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const bool v0 = sm.valid[b][8 * j + 2 * c] != 0, v1 = sm.valid[b][8 * j + 2 * c + 1] != 0;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            s[4 * j + 2 * r] = v0 ? s[4 * j + 2 * r] * a.scale_log2 : -INFINITY;
            s[4 * j + 2 * r + 1] = v1 ? s[4 * j + 2 * r + 1] * a.scale_log2 : -INFINITY;
            bmax[r] = fmaxf(bmax[r], fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
          }
        }
        float alpha[2], mm[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          bmax[r] = fmaxf(bmax[r], __shfl_xor_sync(0xffffffffu, bmax[r], 1));
          bmax[r] = fmaxf(bmax[r], __shfl_xor_sync(0xffffffffu, bmax[r], 2));
          const float m_new = fmaxf(m_r[r], bmax[r]);
          alpha[r] = m_new == -INFINITY ? 1.0f : exp2f(m_r[r] - m_new);
          m_r[r] = m_new;
          mm[r] = m_new == -INFINITY ? 0.0f : m_new;
        }
        uint32_t pp[16];  // BF16 pairs: (tile j, row r) -> pp[2j + r]
        float bsum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float p0 = exp2f(s[4 * j + 2 * r] - mm[r]),
                        p1 = exp2f(s[4 * j + 2 * r + 1] - mm[r]);
            bsum[r] += p0 + p1;
            pp[2 * j + r] = sm90::pack_bf16x2(p0, p1);
          }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          bsum[r] += __shfl_xor_sync(0xffffffffu, bsum[r], 1);
          bsum[r] += __shfl_xor_sync(0xffffffffu, bsum[r], 2);
          l_r[r] = l_r[r] * alpha[r] + bsum[r];
        }
        // Hand P and the rescale factors to WG1 once it is done with the previous block's.
        sm90::named_barrier_sync(kBarPFree, kPair);
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = r0 + 8 * r;
            *reinterpret_cast<uint32_t*>(sm.p + row * 128 + ((j ^ (row & 7)) << 4) + 4 * c) =
                pp[2 * j + r];
          }
        if (c == 0) {
          sm.alpha[r0] = alpha[0];
          sm.alpha[r0 + 8] = alpha[1];
        }
        sm90::fence_proxy_async_smem();
        sm90::named_barrier_arrive(kBarPReady, kPair);

#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j] *= alpha[0];
          o[4 * j + 1] *= alpha[0];
          o[4 * j + 2] *= alpha[1];
          o[4 * j + 3] *= alpha[1];
        }
        sm90::warpgroup_fence_operands(o);
        sm90::warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint32_t af[4] = {pp[4 * kk], pp[4 * kk + 1], pp[4 * kk + 2], pp[4 * kk + 3]};
          sm90::Bf16MmaRS<256, sm90::Major::MN>::wgmma(af, sm90::desc_region_mnmajor(k_addr, 0, kk),
                                                       o, true);
        }
        sm90::warpgroup_commit_batch();
        sm90::warpgroup_wait<0>();
        sm90::warpgroup_fence_operands(o);
        if (i + kKBufs < nb) release(b);
      }
      // Per-row output factor for both consumer warpgroups.
      if (c == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = r0 + 8 * r;
          float fin = 1.0f;
          if (a.num_splits == 1) {
            fin = 0.0f;  // no valid key: the reference's acc / inf = 0
            if (m_r[r] != -INFINITY)
              fin =
                  1.0f / (l_r[r] + exp2f(__ldg(a.sink + h0 + row) * 1.4426950408889634f - m_r[r]));
          } else {
            float* part =
                a.partials +
                ((int64_t(t) * a.n_heads + h0 + row) * a.num_splits + split) * kPartialFloats;
            part[kHeadDim] = m_r[r];
            part[kHeadDim + 1] = l_r[r];
          }
          sm.fin[row] = fin;
        }
      }
      __syncwarp();  // sm.fin of this warp's rows (written by lane c == 0 of each quad)
      sm90::named_barrier_arrive(kBarEpi, kPair);
    } else {
      // ---------------------------------------------------------------- P V (dims 256-511)
      // (keeps the launch allocation of C::kRegsWg1 registers)
      sm90::named_barrier_arrive(kBarPFree, kPair);
      for (int i = 0; i < nb; ++i) {
        const int b = i % kKBufs;
        const uint32_t k_addr = sm90::smem_u32(sm.k[b]);
        wait(&sm.full[b], uint32_t(i / kKBufs) & 1u);
        sm90::fence_proxy_async_smem();
        sm90::named_barrier_sync(kBarPReady, kPair);
        const float al0 = sm.alpha[r0], al1 = sm.alpha[r0 + 8];
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j] *= al0;
          o[4 * j + 1] *= al0;
          o[4 * j + 2] *= al1;
          o[4 * j + 3] *= al1;
        }
        sm90::warpgroup_fence_operands(o);
        sm90::warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          sm90::Bf16MmaSS<256, sm90::Major::MN>::wgmma(sm90::desc_region_kmajor(p_addr, kk),
                                                       sm90::desc_region_mnmajor(k_addr, 4, kk), o,
                                                       true);
        sm90::warpgroup_commit_batch();
        sm90::warpgroup_wait<0>();
        sm90::warpgroup_fence_operands(o);
        if (i + 1 < nb) sm90::named_barrier_arrive(kBarPFree, kPair);
        if (i + kKBufs < nb) release(b);
      }
      sm90::named_barrier_sync(kBarEpi, kPair);
    }

    // Epilogue: rows r0, r0 + 8; this warpgroup's 256 dims, column 8j + 2c (+1).
    const int d0 = 256 * wgi;
    if (a.num_splits == 1) {
      // BF16 rows through shared memory, then 16-byte stores of whole rows (the 4-byte stores
      // straight from the fragments queued in the LSU for ~15 % of the consumers' time). The Q
      // tile is free: every S = Q K^T of this CTA has completed (WG1 is past kBarEpi, which
      // WG0 reaches after its last block). Its 128-byte swizzle keeps both passes conflict-free.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = r0 + 8 * r;
        const float fin = sm.fin[row];
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<uint32_t*>(sm.q + sm90::sw128_bf16_offset(row, d0 + 8 * j + 2 * c)) =
              sm90::pack_bf16x2(o[4 * j + 2 * r] * fin, o[4 * j + 2 * r + 1] * fin);
      }
      if (wgi == 0)  // constant ids (a computed one makes ptxas reserve all 16)
        sm90::named_barrier_sync(kBarOut0, 128);
      else
        sm90::named_barrier_sync(kBarOut0 + 1, 128);
      // This warpgroup's 64 rows x 256 dims: a warp stores 512 contiguous bytes of one row.
      __nv_bfloat16* out = a.out + (int64_t(t) * a.n_heads + h0) * kHeadDim + d0;
#pragma unroll 4
      for (int i = 0; i < 16; ++i) {
        const int q = wt + 128 * i, row = q >> 5, col = 8 * (q & 31);
        *reinterpret_cast<uint4*>(out + int64_t(row) * kHeadDim + col) =
            *reinterpret_cast<const uint4*>(sm.q + sm90::sw128_bf16_offset(row, d0 + col));
      }
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = r0 + 8 * r;
        float* part =
            a.partials +
            ((int64_t(t) * a.n_heads + h0 + row) * a.num_splits + split) * kPartialFloats + d0 +
            2 * c;
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<float2*>(part + 8 * j) =
              make_float2(o[4 * j + 2 * r], o[4 * j + 2 * r + 1]);
      }
    }
  }  // consumers
  // A CTA of a pair leaves only once its peer is done with its shared memory and barriers.
  if constexpr (kCluster == 2) sm90::cluster_sync();
}

template <int kCluster, WgProducer kP>
void launch_wgmma_t(const AttnArgs& a, cudaStream_t stream) {
  const size_t smem = sizeof(WgSmem<kCluster, kP>) + 1024;
  static std::atomic<uint64_t> attr{0};
  once_per_device(attr, [&] {
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(sparse_attn_wgmma_kernel<kCluster, kP>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  });
  LaunchConfig c{dim3(unsigned(int64_t(a.num_tokens) * a.head_tiles), unsigned(a.num_splits)),
                 dim3(C::kThreads), smem, stream, a.pdl};
  c.cluster = dim3(kCluster, 1, 1);
  launch_kernel(c, sparse_attn_wgmma_kernel<kCluster, kP>, a);
}
}  // namespace

// Head tiles in pairs (n_heads a multiple of 128): CTA pairs of one token share each key
// block's decode; otherwise every CTA decodes its whole block.
void launch_wgmma(const AttnArgs& a, WgProducer producer, bool pairs_allowed, cudaStream_t stream) {
  const bool pairs = pairs_allowed && a.head_tiles % 2 == 0;
  switch (producer) {
    case WgProducer::kStaged:
      return pairs ? launch_wgmma_t<2, WgProducer::kStaged>(a, stream)
                   : launch_wgmma_t<1, WgProducer::kStaged>(a, stream);
    case WgProducer::kDirect:
      return pairs ? launch_wgmma_t<2, WgProducer::kDirect>(a, stream)
                   : launch_wgmma_t<1, WgProducer::kDirect>(a, stream);
    case WgProducer::kPredecoded:
      DSV4_CHECK(!pairs, "sparse_attention: predecoded keys run without CTA pairs");
      return launch_wgmma_t<1, WgProducer::kPredecoded>(a, stream);
  }
}

bool wgmma_available() {
  return true;
}

}  // namespace dsv4::cuda::sparse_attn_detail

#else  // !DSV4_HAVE_CUTLASS

namespace dsv4::cuda::sparse_attn_detail {
void launch_wgmma(const AttnArgs&, WgProducer, bool, cudaStream_t) {
  DSV4_CHECK(false, "sparse_attention: the wgmma kernel needs the CUTLASS/CuTe headers");
}
bool wgmma_available() {
  return false;
}
}  // namespace dsv4::cuda::sparse_attn_detail

#endif
