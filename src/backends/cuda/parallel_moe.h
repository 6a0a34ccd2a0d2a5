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
// follows its own batch (moe_gemm_choice: path and tile), so it is not bit-identical to one rank
// unless the tile variant is the same: held to the end-to-end tolerance. A rank with no rows still
// takes part in every exchange (with zero bytes). Not capturable into a CUDA graph (the host
// synchronisation of step 2).
//
// Decode steps (set_decode_rows(D > 0): every dp group's batch is at most D rows, the same D on
// every rank) take another exchange, with no host-known counts, so they are capturable into CUDA
// graphs (moe_exchange.h):
//  1. each rank routes its share (stage Route) and packs its rows' experts, weights and
//     quantised x into a slab of cap = ceil(D / group size) rows with the row count in front;
//  2. the EP group all-gathers the slabs (P x cap rows reach every owner);
//  3. each owner keeps the slots of its experts (at most min(top-k, its experts) distinct ones
//     per row; the others, and rows past a slab's count, are no pairs), runs its experts over
//     them (stages Plan + GateUp + Down) and sums each row's outputs in fp32 in ascending
//     expert index (0 for rows without pairs);
//  4. all-to-all of the fp32 partial sums, cap rows per sender: each rank adds its owners' in
//     owner order (so in ascending expert index, grouped by owner), + the shared expert,
//     rounded once;
//  5. the group's ranks exchange their shares' rows (sizes from the batch, host-known).
// Why an all-gather of the routed rows rather than all-to-all(v) into fixed-capacity slots: at
// decode each row goes to up to min(top-k, P) owners, and a fixed slot per (sender, owner)
// must hold cap x min(top-k, experts per owner) pairs, so a padded all-to-all moves
// P x top-k x cap BF16 rows of dim each way (4 top-k P cap dim bytes per rank), the all-gather
// P x cap BF16 rows there and P x cap fp32 rows back (6 P cap dim bytes): 2 top-k / 3 = 4 times
// fewer at V4's top-k 6, and the counts need no exchange of their own. (The host-sized
// exchange moves only the real pairs, about 4 min(top-k, P) m dim bytes for m rows: half the
// all-gather's at P = 8, but at the price of a host synchronisation per layer.) Each owner also
// reads every row's routing (P x cap x top-k ids), which is small. The fp32 partial sums differ
// from the one-rank combine (one running sum over all the row's experts) in rounding only: held to
// the same tolerance. Prefill and mixed steps keep the host-sized exchange above (they are not
// captured).
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
  // exchange figure), and the decode exchange's slabs for up to `max_decode_rows` rows per dp
  // group.
  CudaParallelMoe(DeviceContext& ctx, const ModelConfig& config, const CudaModelWeights& weights,
                  const CudaRankContext& rank, int max_tokens, int max_decode_rows, void* token_ws,
                  size_t token_ws_bytes);
  ~CudaParallelMoe();
  CudaParallelMoe(const CudaParallelMoe&) = delete;
  CudaParallelMoe& operator=(const CudaParallelMoe&) = delete;

  // y [n, dim] = routed experts of x [n, dim] (ffn_norm output) + shared [n, dim], for the n
  // rows of this rank's dp group (the same on every rank of the group); n = 0 on a rank
  // without work (x, tokens, shared, y unused).
  void forward(const CudaBlockWeights& b, const __nv_bfloat16* x, const int32_t* tokens,
               const __nv_bfloat16* shared, int n, __nv_bfloat16* y, cudaStream_t stream);

  // The next forwards are decode steps of at most `rows` rows per dp group (every rank of the
  // world sets the same value), exchanged by the capturable decode exchange; 0: the
  // host-sized exchange. rows <= max_decode_rows.
  void set_decode_rows(int rows);
  int decode_rows() const { return decode_rows_; }

 private:
  void decode_exchange(const CudaBlockWeights& b, const __nv_bfloat16* xs, const int32_t* ts,
                       const __nv_bfloat16* shared, int m, __nv_bfloat16* y, cudaStream_t stream);

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
  // The decode exchange (ep > 1): capacities for max_decode_rows, the step's D.
  int max_decode_rows_ = 0, decode_rows_ = 0;
  uint8_t* slab_ = nullptr;   // this rank's slab
  uint8_t* slabs_ = nullptr;  // [ep] everyone's
  float* partial_ = nullptr;  // [ep * cap, dim] the owner's sums per gathered row
  float* parts_ = nullptr;    // [ep * cap, dim] every owner's sums for this rank's rows
};

}  // namespace dsv4
