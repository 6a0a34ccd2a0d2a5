// The MoE across the ranks of the parallel engine, bit for bit cpu::moe_forward on one rank:
// every rank routes its rows (the router is on every rank); the rows of a dp group are shared
// out among the group's ranks; each rank dispatches its share's (row, expert) pairs to the
// experts' owners in its EP group (all-to-all), the owners run their experts over what they
// received, the outputs return (all-to-all) and are combined in ascending expert index with
// the shared expert, as moe_forward combines them; the group's ranks then exchange their rows.
// An expert's output row depends only on its input row, so neither the split nor the order in
// which owners batch rows changes a bit. A rank with no rows still takes part in every
// exchange.
#pragma once

#include <cstdint>

#include "backends/cpu/rank_context.h"
#include "ops/cpu/moe.h"

namespace dsv4 {

void moe_forward_parallel(const cpu::MoeWeights& w, const cpu::MoeParams& p, const float* x,
                          const int32_t* tokens, int n, int dim, float* y, const RankContext& rank,
                          int32_t* route_experts = nullptr, float* route_weights = nullptr);

}  // namespace dsv4
