// Launchers of the MoE kernels (moe_route.cu, moe_gemm_*.cu), used by moe.cu.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/moe/moe.h"
#include "ops/cuda/moe/moe_config.h"
#include "ops/cuda/moe/moe_launch.h"

namespace dsv4::cuda::moe {

// Router logits tile (rows x experts per CTA) for m rows.
inline int router_tile_m(int m) {
  return m <= kRouterSmallTM ? kRouterSmallTM : m <= kRouterMidTM ? kRouterMidTM : kRouterLargeTM;
}
inline int router_tile_e(int m) {
  return m <= kRouterSmallTM ? kRouterSmallTE : m <= kRouterMidTM ? kRouterMidTE : kRouterLargeTE;
}

void launch_router_logits(const LaunchCtx& c, const __nv_bfloat16* x, const uint16_t* gate, int m,
                          int n_experts, int dim, int ksplit, double* out, int32_t* counters);
void launch_route_finish(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                         const MoeWorkspace& ws);
void launch_plan(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                 const MoeWorkspace& ws, int tile_n);
// Decode-sized batches: selection + x quantisation + grouping in one single-CTA kernel.
bool route_plan_fused(int m, int n_experts);
void launch_route_plan_small(const LaunchCtx& c, const MoeDeviceWeights& w, const MoeArgs& a,
                             const MoeWorkspace& ws, int tile_n);
void launch_quant_rows(const LaunchCtx& c, const __nv_bfloat16* in, __nv_bfloat16* out,
                       int max_rows, int cols, const int32_t* counters);
void launch_combine(const LaunchCtx& c, const MoeWorkspace& ws, int m, int top_k,
                    const __nv_bfloat16* shared, __nv_bfloat16* y, int dim);

}  // namespace dsv4::cuda::moe
