// Tile geometry of the MoE kernels (all of it; heuristics that pick among these live in
// moe.cu).
#pragma once

#include <cstddef>

namespace dsv4::cuda::moe {

// ---- grouped FP4 expert GEMM (W4A16: FP4 weights dequantised to BF16 in registers, BF16
// wgmma, fp32 accumulation) -----------------------------------------------------------------
// D[rows, tokens] = W[rows, K] * X[tokens, K]^T: the weights are the 64-row A operand of
// m64nBNk16 wgmmas; a CTA owns WGS warpgroups x MT m64 tiles of weight rows and one tile of
// BN tokens of one expert. KC k-blocks of 64 per pipeline stage; STAGES stages (two always in
// flight beyond the one being computed).
// KG k16 steps are dequantised, then issued as one wgmma group (4 = one group per k-block:
// fewer fence/commit/wait instructions, twice the A-fragment registers in flight).
template <int BN_, int WGS_, int MT_, int KC_, int STAGES_, int KG_>
struct GemmTile {
  static constexpr int BN = BN_;          // tokens per tile (wgmma N)
  static constexpr int WGS = WGS_;        // consumer warpgroups per CTA
  static constexpr int MT = MT_;          // m64 tiles per warpgroup
  static constexpr int KC = KC_;          // 64-wide k-blocks per stage (even)
  static constexpr int STAGES = STAGES_;  // >= 3
  static constexpr int KG = KG_;          // 1, 2 or 4
  static constexpr int THREADS = 128 * WGS;
  static constexpr int BM = 64 * WGS * MT;  // weight rows per CTA tile
  static_assert(BN % 8 == 0 && BN <= 256, "wgmma N");
  static_assert(KC % 2 == 0 && STAGES >= 3 && 4 % KG == 0, "pipeline");
};

// Decode: a few tokens per expert; 1 warpgroup, deep K stages, several CTAs per SM; the
// dequantisation (ALU) is the work, so the wgmma bookkeeping is amortised over a k-block.
using TileN8 = GemmTile<8, 1, 1, 4, 5, 4>;
using TileN32 = GemmTile<32, 1, 1, 2, 5, 4>;
// Prefill: 256 weight rows per CTA so the activation tile is re-read from L2 half as often;
// one k16 step per wgmma group keeps the A registers next to 64-128 accumulators.
using TileN64 = GemmTile<64, 2, 2, 2, 4, 1>;
using TileN128 = GemmTile<128, 2, 2, 2, 4, 1>;
// 256 tokens x 128 weight rows (one m64 tile a warpgroup, m64n256 wgmmas; MMA widths 64 / 128 /
// 192 / 256 by the tile's rows): each dequantised weight fragment feeds twice the columns of
// the 128 tile (half the dequantisation and A-register traffic per MMA), for 1.46x the bytes a
// stage (64 KB of activations + 9 KB of weights; 3 stages fill the 227 KB). CUTLASS's RS
// mixed-input GEMM gained 20-25 % from 128x128 to 128x256 on wo_a (H200, stop 42). In the plain
// kernel (moe_gemm.cuh) only when forced: slower than its 128 tile (H100, M 8192 gate/up + down
// 6571 vs 5954 us); the warp-specialised kernel (moe_gemm_ws.cuh) takes it from
// kWsTile256MinRows rows an expert.
using TileN256 = GemmTile<256, 2, 1, 2, 3, 1>;

// ---- decode expert GEMM (moe_gemm_stream.cuh): the same W4A16 mainloop, warp-specialised ----
// One persistent CTA per SM walks (token tile, 64-row block) items; a producer warp keeps a
// STAGES-deep ring of KC k-blocks full across items (one bulk copy of the block's contiguous
// packed weights per stage + cp.async of the tile's activation rows); CONSUMERS consumer
// warpgroups split every stage's K (one 128-wide block each: the down GEMM's FP8 activation
// blocks) and add their partial sums once per item (into warpgroup 0, in warpgroup order).
// 64-row items keep every SM busy from one token (6 experts x 64 row blocks = 384 items on 132
// SMs). The dequantisation is the ALU work (~85 instructions per thread and 64x64 tile): two
// warpgroups need ~2/3 issue efficiency for 4.8 TB/s; more consumers trade stages for issue
// slots.
template <int BN_, int STAGES_, int CONSUMERS_ = 2>
struct StreamTile {
  static constexpr int BN = BN_;                // tokens per tile (wgmma N)
  static constexpr int CONSUMERS = CONSUMERS_;  // consumer warpgroups (1..4)
  static constexpr int KC = 2 * CONSUMERS;      // k-blocks per stage: one 128 block each
  static constexpr int STAGES = STAGES_;
  static constexpr int THREADS = 128 * CONSUMERS + 32;  // + the producer warp
  static constexpr int BM = 64;                         // weight rows per item
  static_assert(BN % 8 == 0 && BN <= 32 && STAGES >= 2 && CONSUMERS >= 1 && CONSUMERS <= 4,
                "stream tile");
};
// 4 consumer warpgroups: with 2 the H200 measured 1.2-1.9 TB/s (no faster than the tiled GEMM;
// the dequantisation's issue rate is the suspect), so more warps per SM to fill issue slots;
// ~110 KB of weights in flight per SM (HBM latency x per-SM share of 4.8 TB/s ~ 55 KB).
using StreamN8 = StreamTile<8, 6, 4>;
using StreamN16 = StreamTile<16, 5, 4>;
// kAuto runs the stream path while the mean rows per active expert (tokens x top-k over the
// experts they can reach) is at most this (and dim and inter are multiples of 128), the tiled
// GEMM beyond: the stream path re-streams an expert's weights for every 16 of its rows, the
// tiled one reads them once per 128-row tile. H200, Flash NVFP4, moe_bench gate/up + quant +
// down, stream (separate quantisation) vs tiled (us), 63f38b7's kernels: M 1 56.7 vs 66.4, M 8
// 232 vs 382, M 16 459 vs 680, M 64 1082 vs 1698, M 128 1271 vs 2130 (Pro M 128 4467 vs 7342);
// 300c7d4: M 256 (6 rows an expert) 1312 vs 2791; 1cdc8a6: M 512 (12) 1509 vs 3962, M 1024
// (24) 2729 vs 5205, M 2048 (48) 4687 vs 3410 (the tiled tile 32 up to 32 rows, 128 beyond).
// Pro NVFP4, fdf8a31: M 256 (4) 5080 vs 8817, M 512 (8) 5360 vs 13224, M 1024 (16) 7738 vs
// 16485, M 2048 (32) 12993 vs 27225. So the stream path wherever the tiled path would take its
// tile 32, which lost at every M measured (tile 128, beyond, won at Flash's 48 rows): Flash up
// to 1365 tokens, Pro up to 2048.
// The tiled path's token tile by mean rows per active expert (moe_heuristic.cpp tiled_tile):
// 8 up to kTiledTile8MaxRows, 32 up to kTiledTile32MaxRows, 128 beyond.
constexpr int kTiledTile8MaxRows = 8;
constexpr int kTiledTile32MaxRows = 32;
// kAuto: where the tiled path takes its 128 tile (beyond kTiledTile32MaxRows rows an expert) the
// warp-specialised kernel runs instead (moe_gemm_ws.cuh): its 128 tile, its 256 tile from this
// many rows an expert. H100 (stop 43, 09d02c5, moe_bench flash nvfp4, gate/up + down us): M 4096
// (96 rows) plain 128 3283, ws128 2779, ws256 3342; M 8192 (192 rows) plain 5954, ws128 5157,
// ws256 5188; the engine's 8K prefill (e2e_depth_bench --quick --layers 8, 43 EXTRAPOLATED):
// plain 128 556.2 ms, plain 256 560.2, ws128 511.4, ws256 499.4 (a CSA layer's expert GEMMs
// 6378 / 5159 / 4743 us plain / ws128 / ws256). 160: between 96 (128 wins) and 192 (256 wins
// in the engine).
constexpr int kWsTile256MinRows = 160;
constexpr int kStreamAutoMaxRowsPerExpert = kTiledTile32MaxRows;
// The stream path's token tile: 8 up to 8 tokens (every expert one tile) and while the mean rows
// per active expert are at most this, 16 beyond (an expert over 8 rows streams its weights once
// per tile). H200, experts with separate quantisation, 16- vs 8-token tiles (us): Flash NVFP4
// (7ad6d24) M 32 (1 row) 680 vs 617, M 64 (2) 1037 vs 946, M 128 (3) 1227 vs 1135; Pro NVFP4
// (fdf8a31) M 128 (2) 4512 vs 4330, M 256 (4) 5080 vs 4758; beyond, 8 loses: Flash M 256 (6)
// 1317 vs 1391, Pro M 512 (8) 5360 vs 7096.
constexpr int kStreamTile8MaxRows = 4;
// The stream path's down GEMM quantises its own activations up to this many tokens (no launch
// of its own); beyond, every CTA of an expert's 64-row blocks repeats the quantisation of its
// tile, with a barrier per stage, and the separate launch (once per row) is faster. H200,
// moe_bench gate/up + quant + down, in the GEMM vs separate (us): Flash NVFP4 M 1 49.3 vs 56.7,
// M 2 84.5 vs 85.6, M 4 151.6 vs 140.4, M 8 265 vs 232, M 128 1482 vs 1271; Pro NVFP4 M 1
// 115.2 vs 110.0, M 2 190.8 vs 174.4, M 128 5444 vs 4467. Since the separate launch takes a
// warp per (row, 128-block) (300c7d4) it wins at one token too: Flash NVFP4 M 1 51.3 vs 47.1,
// Pro 113.9 vs 95.5 (the down GEMM alone 30.8 vs 22.5 / 58.0 vs 41.5): 0 = never in kAuto,
// the in-GEMM variant stays for a forced MoeDownQuant::kInDown.
constexpr int kStreamQuantInDownMaxTokens = 0;

// ---- router (moe_route.cu): fp64 sums of the exact BF16 x BF16 products, no split partials ----
// Three kernels (MoeArgs::router_path forces one; kAuto picks by rows). The K-parallel kernel (a
// CTA of 256 threads per 8 rows x 2-4 experts, each thread a slice of K, the 256 partial sums added
// in a fixed tree): 128-384 CTAs at the real shapes from one token on. The fp64 tensor-core kernel:
// 8 rows x 8 NT experts per CTA, K split over a cluster of kRouterCluster CTAs (their partial sums
// added in rank order through distributed shared memory). The tiled kernel: kRouterTileM x
// kRouterTileE tiles on fp64 tensor cores straight from registers, every output summed over the
// whole K by one warp (each x row and gate row read once per tile, not per 8-16 rows as the
// cluster kernel does; but one CTA walks all of K: ~230 us at Flash's dim even for one row).
constexpr int kRouterGemvRows = 256;  // the K-parallel kernel's limit when forced
// kAuto: the K-parallel kernel up to here, then MMA. H200 (route stage alone): M=1 gemv 11.2 /
// mma 11.9 us Flash, 12.8 / 15.3 Pro; M=8 gemv 15.0 / mma 13.2 Flash, 20.5 / 16.5 Pro; M=2..4 not
// measured: the crossover interpolates to ~3 (Flash) / ~4 (Pro), 2 is the conservative pick.
constexpr int kRouterAutoGemvRows = 2;
// kAuto: the MMA kernel up to here, the tiled kernel beyond. H200 (route stage alone, session
// 39): Flash M=512 mma 75 / tiled 287 us, M=4096 462 / 291; Pro M=512 163 / 454, M=4096 1121 /
// 878. The MMA kernel grows ~linearly in M (0.11 us a row Flash, 0.27 Pro), the tiled one by
// waves of (E / 128) x (M / 64) CTAs from its ~230 / ~390 us floor: crossover ~2300 rows
// (Flash), ~1500 (Pro); 2048 is between (M 1024-2048 not measured).
constexpr int kRouterAutoMmaRows = 2048;
constexpr int kRouterCluster = 4;
constexpr int kRouterTileM = 64, kRouterTileE = 128;  // the tiled kernel's CTA tile

// ---- routing / grouping ----------------------------------------------------------------------
constexpr int kMaxExperts = 1024;  // plan kernel: one thread per expert
constexpr int kMaxTopK = 16;
constexpr int kPlanThreads = 1024;
// From this many (row, slot) pairs the grouping runs over many CTAs (moe_route.cu, plan_count /
// plan_scan / plan_place): one CTA walking 49,152 pairs took 136 us of the 8K prefill's CSA
// layer on the H200. Each CTA of the count and place kernels takes kPlanChunk pairs.
constexpr int kPlanMultiMinPairs = 8192;
constexpr int kPlanChunk = 512;
constexpr int kPlanChunkThreads = 256;
constexpr long plan_chunks(long pairs) {
  return (pairs + kPlanChunk - 1) / kPlanChunk;
}
constexpr int kFinishWarps = 8;  // route_select: one warp per token
// Up to this many rows (and scores fitting the shared memory below) selection and grouping
// run as one single-CTA kernel (which stages them twice: biased and raw).
constexpr int kFusedRouteRows = 32;
constexpr size_t kFusedRouteSmem = 64 * 1024;

// ---- FP8 activation quantisation: per (row, 128) e4m3 with a UE8M0 scale ------------------
constexpr int kActBlock = 128;

}  // namespace dsv4::cuda::moe
