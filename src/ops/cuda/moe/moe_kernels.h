// Launchers of the MoE kernels (moe_route.cu, moe_gemm_*.cu), used by moe.cu.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "ops/cuda/moe/moe.h"
#include "ops/cuda/moe/moe_config.h"
#include "ops/cuda/moe/moe_launch.h"

namespace dsv4::cuda::moe {

// Router logits, scores and the x quantisation (many CTAs at every m); the kernel it runs for m
// rows (benchmarks name it).
void launch_router(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                   const MoeWorkspace& ws);
// The path kAuto resolves to (a forced one is checked against the row count), and its kernel.
RouterPath router_path_choice(int m, RouterPath requested);
std::string router_kernel_name(int m, RouterPath requested = RouterPath::kAuto);
// Selection and weights from the scores: one warp per row over many CTAs.
void launch_route_select(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                         const MoeWorkspace& ws);
void launch_plan(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                 const MoeWorkspace& ws, int tile_n);
// Decode-sized batches: selection + grouping in one single-CTA kernel.
bool route_plan_fused(int m, int n_experts);
void launch_route_plan_small(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                             const MoeWorkspace& ws, int tile_n);
void launch_quant_rows(const LaunchCtx& c, const __nv_bfloat16* in, __nv_bfloat16* out,
                       int max_rows, int cols, const int32_t* counters);
void launch_combine(const LaunchCtx& c, const MoeWorkspace& ws, int m, int top_k,
                    const __nv_bfloat16* shared, __nv_bfloat16* y, int dim);

}  // namespace dsv4::cuda::moe
