// Mixture of experts on the GPU (sm_90a), the CUDA twin of cpu::moe_forward:
//   router: fp32 logits (exact products of x and the BF16 gate summed in fp64, rounded once),
//           sqrt-softplus or sigmoid (each fp32 operation correctly rounded),
//           top-k on score + bias (ties to the lower expert index) or tid2eid for hash
//           layers, normalise, x route_scale                                   (= cpu::moe_route)
//   x is FP8-fake-quantised per (row, 128) (e4m3, UE8M0 scale; the values stay BF16)
//   grouping: (token, slot) pairs sorted by expert, a hash row's repeated expert counted once
//   gate/up: one grouped launch over (expert, token tile, 256/64 weight rows) of FP4 W4A16
//           GEMMs, SwiGLU clamp and the routing weight fused: a = bf16(w * silu(g) * u)
//   a is FP8-fake-quantised per (row, 128) (inside the down GEMM for decode tiles)
//   down: one grouped launch, BF16 expert outputs
//   combine: fp32 sum over the row's experts in ascending expert index, + the shared expert's
//           output (a BF16 input), rounded to BF16                      (= cpu::moe_forward)
// Expert weights: MXFP4 or NVFP4 (one format per layer), repacked at load (fp4_pack.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/common/score_func.h"
#include "ops/common/weight_refs.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/moe/fp4_pack.h"

namespace dsv4::cuda::moe {

// One layer's router and routed experts on the device.
struct MoeDeviceWeights {
  ExpertFormat format = ExpertFormat::kMxfp4;
  int n_experts = 0, dim = 0, inter = 0;
  int hash_top_k = 0, vocab = 0;  // hash layers: tid2eid [vocab, hash_top_k]
  DeviceBuffer<uint8_t> w13, w2;  // packed; expert e at e * stride
  size_t w13_stride = 0, w2_stride = 0;
  DeviceBuffer<Fp4Epilogue> epi13, epi2;  // [E]
  DeviceBuffer<uint16_t> gate;            // BF16 bits [E, dim]
  DeviceBuffer<float> bias;               // [E] (score routing) or empty
  DeviceBuffer<int32_t> tid2eid;          // [vocab, top_k] (hash routing) or empty
  bool hash() const { return tid2eid.size() > 0; }
  // Bytes of one expert's three projections as the checkpoint stores them (4.25 bits per
  // weight MXFP4, 4.5 NVFP4): the "effective bytes" of the benchmarks.
  double expert_checkpoint_bytes() const;
};

// Validates, repacks (fp4_pack.h) and uploads one layer's gate, bias or tid2eid and routed
// experts. The shared expert is not part of it (its output is an input of moe_forward).
// Throws dsv4::Error naming the tensor on anything unsupported (mixed formats in one layer,
// shapes off the tile grid, NaN scales, tid2eid ids out of range).
MoeDeviceWeights upload_moe_weights(const MoeRef& ref);

struct MoeParams {
  int top_k = 0;
  ScoreFunc score_func = ScoreFunc::kSqrtSoftplus;  // or kSigmoid (softmax: not on CUDA)
  float route_scale = 1;
  float swiglu_limit = 0;  // 0 = no clamp
};

// Stages of moe_forward (a mask selects which run; tests and benchmarks time them apart).
enum MoeStage : unsigned {
  kStageRoute = 1u << 0,     // router logits, top-k / hash, weights, x quantisation
  kStagePlan = 1u << 1,      // grouping by expert, tile list
  kStageGateUp = 1u << 2,    // grouped w1/w3 GEMM + SwiGLU + routing weight
  kStageQuantAct = 1u << 3,  // FP8 fake-quant of the SwiGLU output
  kStageDown = 1u << 4,      // grouped w2 GEMM
  kStageCombine = 1u << 5,   // sum + shared, BF16
  kStageAll = 0x3fu,
};

// Which grouped expert GEMM runs the gate/up and down stages (moe_heuristic.cpp chooses for
// kAuto; an explicit choice that does not fit the shape is an error, never a fallback).
enum class MoeGemmPath {
  kAuto,
  kStream,   // few rows per expert: warp-specialised bulk-copy weight stream (moe_gemm_stream.cuh);
             // tiles 8, 16
  kTiled,    // moe_gemm.cuh; tiles 8, 32, 64, 128, 256 (256 only when forced)
  kTiledWs,  // moe_gemm_ws.cuh: the tiled GEMM fed by a producer warpgroup through a ring that
             // persists across items; tiles 128, 256 (0: 256); kAuto's pick where the tiled
             // path would take its 128 tile
};
const char* moe_gemm_path_name(MoeGemmPath p);

// Where the down GEMM's FP8-fake-quantised activations come from: the down GEMM itself (each
// CTA quantises its activation tile in shared memory; no launch of its own) or the separate
// quantisation launch (stage QuantAct). The stream path does either (kAuto: by tokens,
// moe_config.h); the tiled path's token tile decides (decode tiles in the GEMM), so forcing the
// other placement on it is an error.
enum class MoeDownQuant {
  kAuto,
  kInDown,
  kSeparate,
};

// Which kernel computes the router logits and scores (moe_route.cu; kAuto: by the row count).
// Each sums the exact products in fp64 in its own fixed order, so each gives cpu::linear's fp32
// logits but for ~1e-7 of them (two fp64 sums straddling an fp32 rounding boundary).
enum class RouterPath {
  kAuto,
  kGemv,   // K-parallel: a CTA per 8 rows x 2-4 experts, K over its 256 threads (rows <= 256)
  kMma,    // fp64 tensor cores: 8 rows x 8-32 experts per CTA, K over a 4-CTA cluster
  kTiled,  // 64 x 64 tiles in shared memory, fp64 FMA
};
const char* router_path_name(RouterPath p);

struct MoeGemmChoice {
  MoeGemmPath path = MoeGemmPath::kTiled;  // never kAuto
  int tile_n = 8;
  bool quant_in_down = true;  // MoeDownQuant resolved
};

struct MoeArgs {
  const __nv_bfloat16* x = nullptr;       // [m, dim] (ffn_norm output)
  const int32_t* tokens = nullptr;        // [m] token ids, hash layers only (< vocab)
  const __nv_bfloat16* shared = nullptr;  // [m, dim] shared expert output; null = zeros
  __nv_bfloat16* y = nullptr;             // [m, dim]
  int m = 0;
  MoeParams p;
  void* workspace = nullptr;  // moe_workspace_bytes(w, m) bytes, 256-byte aligned
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
  unsigned stages = kStageAll;
  // Expert GEMM: path and token tile. kAuto with tile_n 0: the heuristic; kAuto with a tile:
  // the tiled GEMM with that tile (8, 32, 64, 128 or 256); kStream / kTiled with tile_n 0: that
  // path's heuristic tile.
  MoeGemmPath gemm_path = MoeGemmPath::kAuto;
  int tile_n = 0;
  MoeDownQuant down_quant = MoeDownQuant::kAuto;
  bool pdl = true;  // programmatic dependent launch between consecutive stages
  // The expert GEMMs' persistent grid: at most this many CTAs (0: every SM's resident CTAs).
  // Tests use it to run many work items per CTA (the rings and item loops wrapping).
  int gemm_ctas = 0;
  RouterPath router_path = RouterPath::kAuto;  // tests and benchmarks force each
  // kMma's rows per CTA (8 or 16; 0: router_mma_tile's choice by m) — for benchmarks.
  int router_mma_rows = 0;
  // Work on another stream that `shared` comes from (the shared expert beside the routed ones):
  // the combine waits for this event, recorded after it, on a.stream; null: none.
  cudaEvent_t shared_ready = nullptr;
};

size_t moe_workspace_bytes(const MoeDeviceWeights& w, int m, int top_k);

// Enqueues the stages on a.stream (no host synchronisation; the expert count per tile list
// stays on the device, the GEMMs are persistent over it).
void moe_forward(const MoeDeviceWeights& w, const MoeArgs& a);

// The expert GEMM (path, token tile) moe_forward runs for m rows with the requested path and
// tile (MoeArgs::gemm_path, tile_n); throws dsv4::Error for a request that does not fit.
// moe_heuristic.cpp.
MoeGemmChoice moe_gemm_choice(const MoeDeviceWeights& w, int m, int top_k,
                              MoeGemmPath path = MoeGemmPath::kAuto, int tile_n = 0,
                              MoeDownQuant quant = MoeDownQuant::kAuto);
// The token tile the heuristic picks for m rows (tests and benchmarks report it).
int moe_default_tile_n(const MoeDeviceWeights& w, int m, int top_k);
// Whether the down GEMM of this choice quantises its activations itself (its quant_in_down: the
// tiled path's decode tiles; the stream path when forced, or in kAuto up to
// kStreamQuantInDownMaxTokens, 0 today). kStageQuantAct then launches nothing, kStageDown does
// both and still fills MoeWorkspace::actq. The int overload: the tiled path's tile.
bool moe_fuses_act_quant(const MoeGemmChoice& c);
bool moe_fuses_act_quant(int tile_n);
// Kernel launches of a full moe_forward for m rows (benchmarks compare with the launch floor).
int moe_launch_count(const MoeDeviceWeights& w, int m, int top_k,
                     MoeGemmPath path = MoeGemmPath::kAuto);

// Named regions of the workspace; every stage's output stays there after moe_forward.
struct MoeWorkspace {
  float* logits = nullptr;          // [m, E] router logits (= cpu::linear of the gate)
  float* scores = nullptr;          // [m, E] their scores (sqrt-softplus or sigmoid)
  int32_t* sel = nullptr;           // [m, K] experts in selection order
  float* wt = nullptr;              // [m, K] routing weights
  __nv_bfloat16* xq = nullptr;      // [m, dim]
  int32_t* counters = nullptr;      // [0] unique pairs P, [1] tiles T, [2] error flags (0 = ok)
  int32_t* pair_pos = nullptr;      // [m, K] position in the sorted list; -1 = repeated expert
  int32_t* sorted_row = nullptr;    // [m*K] token row of each position
  float* sorted_wt = nullptr;       // [m*K]
  int32_t* expert_first = nullptr;  // [E + 1] first position of each expert
  int4* tiles = nullptr;            // [m*K] (expert, first position, rows, 0)
  int32_t* plan_counts = nullptr;   // [chunks of kPlanChunk pairs, E] the multi-CTA grouping's
  __nv_bfloat16* act = nullptr;     // [m*K, inter] SwiGLU output
  __nv_bfloat16* actq = nullptr;    // [m*K, inter] its FP8 fake-quantisation
  __nv_bfloat16* ye = nullptr;      // [m*K, dim] expert outputs (BF16, unweighted sum terms)
};
MoeWorkspace carve_moe_workspace(const MoeDeviceWeights& w, int m, int top_k, void* base);

// Error flags of counters[2].
constexpr int kErrTokenRange = 1;   // a token id outside [0, vocab) on a hash layer (clamped)
constexpr int kErrExpertRange = 2;  // a selected expert id outside [0, E) (skipped)

}  // namespace dsv4::cuda::moe
