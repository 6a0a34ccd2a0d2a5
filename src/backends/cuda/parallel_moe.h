// The MoE across the ranks of the CUDA backend's parallel engine (the twin of the CPU
// backend's moe_forward_parallel), built from the stages of cuda::moe::moe_forward:
//  1. the rows of a dp group are shared out among the group's ranks; each rank routes its
//     share (the router is on every rank) and groups the (row, expert) pairs by expert
//     (stages Route + Plan over all experts): the pairs of an expert owner's range are one
//     contiguous run of the sorted list;
//  2. the EP group all-gathers every rank's expert_first (one stream synchronisation per
//     layer: the exchange sizes are host-side), each rank sends each owner its run (the
//     quantised x rows and the routing weights; the owner derives the expert ids from the
//     counts) with all-to-all(v);
//  3. each owner runs its experts over what arrived (stages Plan + GateUp + Down with one pair
//     per row) and sends each sender its outputs in the order they came;
//  4. the sender puts them back at their sorted positions and runs the Combine stage: the
//     row's experts summed in ascending expert index in fp32, + the shared expert, rounded
//     once — the one-rank combine;
//  5. the group's ranks exchange their shares' rows.
// An expert output row depends only on its input row and weight, but the owner's token tile
// follows its own batch (moe_default_tile_n), so it is not bit-identical to one rank unless
// the tile variant is the same: held to the end-to-end tolerance. A rank with no rows still
// takes part in every exchange (with zero bytes). Not capturable into a CUDA graph (the host
// synchronisation of step 2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "backends/cuda/device_context.h"
#include "backends/cuda/rank_context.h"
#include "backends/cuda/weights.h"
#include "model/model_config.h"

namespace dsv4 {

class CudaParallelMoe {
 public:
  // Buffers for dp-group steps of up to `max_tokens` rows, carved from ctx; the rank's own
  // rows use the model's MoE workspace (`token_ws`, moe_workspace_bytes of the router for
  // max_tokens rows). The owner's buffers hold what may arrive: from each dp group in the EP
  // group, max_tokens rows of at most min(top-k, experts here) pairs each (the memory plan's
  // exchange figure).
  CudaParallelMoe(DeviceContext& ctx, const ModelConfig& config, const CudaModelWeights& weights,
                  const CudaRankContext& rank, int max_tokens, void* token_ws,
                  size_t token_ws_bytes);
  ~CudaParallelMoe();
  CudaParallelMoe(const CudaParallelMoe&) = delete;
  CudaParallelMoe& operator=(const CudaParallelMoe&) = delete;

  // y [n, dim] = routed experts of x [n, dim] (ffn_norm output) + shared [n, dim], for the n
  // rows of this rank's dp group (the same on every rank of the group); n = 0 on a rank
  // without work (x, tokens, shared, y unused).
  void forward(const CudaBlockWeights& b, const __nv_bfloat16* x, const int32_t* tokens,
               const __nv_bfloat16* shared, int n, __nv_bfloat16* y, cudaStream_t stream);

 private:
  const ModelConfig& cfg_;
  const CudaRankContext& rank_;
  int max_tokens_ = 0, max_recv_ = 0;
  void* token_ws_ = nullptr;  // Route/Plan/Combine workspace of this rank's share (the model's)
  size_t token_ws_bytes_ = 0;
  void* owner_ws_ = nullptr;  // the owner's Plan/GateUp/Down workspace (one pair per row)
  size_t owner_ws_bytes_ = 0;
  __nv_bfloat16* send_x_ = nullptr;  // [max_tokens * top_k, dim] the sorted pairs' x rows
  __nv_bfloat16* back_ = nullptr;    // [max_recv, dim] outputs in arrival order
  int32_t* first_all_ = nullptr;     // [ep, E + 1] every EP rank's expert_first
  int32_t* host_first_ = nullptr;    // pinned copy
  int32_t* host_sel_ = nullptr;      // pinned [max_recv] local expert of each arriving pair
};

}  // namespace dsv4
