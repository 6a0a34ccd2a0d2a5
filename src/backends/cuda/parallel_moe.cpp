#include "backends/cuda/parallel_moe.h"

#include <algorithm>
#include <cstring>

#include "backends/cuda/glue.h"
#include "backends/cuda/moe_exchange.h"
#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/moe/moe.h"

namespace dsv4 {
namespace {

using bf16 = __nv_bfloat16;
namespace moe = cuda::moe;

// The largest workspace over 0..m_max rows (the router's K-split, and so its partial logits,
// varies with m).
size_t workspace_upto(const moe::MoeDeviceWeights& w, int m_max, int top_k) {
  size_t best = moe::moe_workspace_bytes(w, m_max, top_k);
  for (int m = 0; m < m_max; ++m) best = std::max(best, moe::moe_workspace_bytes(w, m, top_k));
  return best;
}

moe::MoeParams params(const ModelConfig& c, int top_k) {
  moe::MoeParams p;
  p.top_k = top_k;
  p.score_func = c.score_func;
  p.route_scale = c.route_scale;
  p.swiglu_limit = c.swiglu_limit;
  return p;
}

}  // namespace

CudaParallelMoe::CudaParallelMoe(DeviceContext& ctx, const ModelConfig& config,
                                 const CudaModelWeights& weights, const CudaRankContext& rank,
                                 int max_tokens, int max_decode_rows, void* token_ws,
                                 size_t token_ws_bytes)
    : cfg_(config),
      rank_(rank),
      max_tokens_(max_tokens),
      token_ws_(token_ws),
      token_ws_bytes_(token_ws_bytes),
      max_decode_rows_(std::max(0, std::min(max_decode_rows, max_tokens))) {
  DSV4_CHECK(rank.layout && rank.group && rank.ep, "parallel MoE without its communicators");
  const int K = config.n_activated_experts, E = config.n_routed_experts, dim = config.dim;
  const int ep = rank.ep->size();
  DSV4_CHECK(!weights.blocks.empty(), "parallel MoE: no blocks");
  const CudaBlockWeights& b0 = weights.blocks[0];
  DSV4_CHECK(token_ws && token_ws_bytes >= moe::moe_workspace_bytes(b0.moe, max_tokens, K),
             "parallel MoE: the model's MoE workspace is smaller than ", max_tokens, " rows need");
  if (ep > 1) {
    const ParallelLayout& L = *rank.layout;
    const int El = L.experts_per_rank();
    DSV4_CHECK(b0.moe_local.n_experts == El, "parallel MoE: the weights hold ",
               b0.moe_local.n_experts, " experts, the layout ", El);
    // Worst case: every row of every dp group in this EP group sends this owner
    // min(top-k, El) pairs (a row's experts are distinct).
    std::vector<char> seen(size_t(L.config().dp), 0);
    int groups = 0;
    for (int w = L.ep_group(rank.rank) * L.config().ep;
         w < (L.ep_group(rank.rank) + 1) * L.config().ep; ++w)
      if (!seen[size_t(L.dp_group(w))]++) ++groups;
    const int64_t recv = int64_t(groups) * max_tokens * std::min(K, El);
    DSV4_CHECK(recv < (int64_t(1) << 31), "parallel MoE: ", recv, " pairs per owner");
    max_recv_ = int(recv);
    // The decode exchange: ep slabs of cap rows, each owner's batch ep x cap rows of top-k
    // slots (its workspace shared with the host-sized exchange's: one runs at a time).
    const int gs = rank.group->size();
    const int cap = (max_decode_rows_ + gs - 1) / gs;
    owner_ws_bytes_ = workspace_upto(b0.moe_local, max_recv_, 1);
    if (cap > 0) {
      owner_ws_bytes_ =
          std::max(owner_ws_bytes_, workspace_upto(b0.moe_local, ep * cap, std::min(K, El)));
      slab_ = reinterpret_cast<uint8_t*>(ctx.allocate(exchange::slab_bytes(cap, K, dim)));
      slabs_ = reinterpret_cast<uint8_t*>(ctx.allocate(exchange::slab_bytes(cap, K, dim) * ep));
      partial_ = reinterpret_cast<float*>(ctx.allocate(size_t(ep) * cap * dim * 4));
      parts_ = reinterpret_cast<float*>(ctx.allocate(size_t(ep) * cap * dim * 4));
    }
    owner_ws_ = ctx.allocate(owner_ws_bytes_);
    send_x_ = reinterpret_cast<bf16*>(ctx.allocate(size_t(max_tokens) * K * dim * 2));
    back_ = reinterpret_cast<bf16*>(ctx.allocate(size_t(max_recv_) * dim * 2));
    first_all_ = reinterpret_cast<int32_t*>(ctx.allocate(size_t(ep) * (E + 1) * 4));
    DSV4_CUDA_CHECK(cudaMallocHost(&host_first_, size_t(ep) * (E + 1) * 4));
    DSV4_CUDA_CHECK(cudaMallocHost(&host_sel_, size_t(max_recv_) * 4));
  }
}

void CudaParallelMoe::set_decode_rows(int rows) {
  DSV4_CHECK(rows >= 0 && rows <= max_decode_rows_, "parallel MoE: decode steps of ", rows,
             " rows per group, planned ", max_decode_rows_);
  decode_rows_ = rows;
}

CudaParallelMoe::~CudaParallelMoe() {
  if (host_first_) cudaFreeHost(host_first_);
  if (host_sel_) cudaFreeHost(host_sel_);
}

void CudaParallelMoe::forward(const CudaBlockWeights& b, const bf16* x, const int32_t* tokens,
                              const bf16* shared, int n, bf16* y, cudaStream_t stream) {
  const ModelConfig& c = cfg_;
  const int K = c.n_activated_experts, E = c.n_routed_experts, dim = c.dim;
  DeviceCommunicator& group = *rank_.group;
  DeviceCommunicator& ep = *rank_.ep;
  DSV4_CHECK(n >= 0 && n <= max_tokens_, "parallel MoE: ", n, " rows, planned ", max_tokens_);
  // 1. This rank's share of the group's rows.
  const int gs = group.size(), gm = group.rank();
  auto share = [&](int m) {
    return std::pair<int, int>{int(int64_t(n) * m / gs), int(int64_t(n) * (m + 1) / gs)};
  };
  const auto [lo, hi] = share(gm);
  const int m = hi - lo;
  const bf16* xs = x ? x + size_t(lo) * dim : nullptr;
  const int32_t* ts = tokens ? tokens + lo : nullptr;

  moe::MoeArgs a;
  a.x = xs;
  a.tokens = ts;
  a.shared = shared ? shared + size_t(lo) * dim : nullptr;
  a.y = y ? y + size_t(lo) * dim : nullptr;
  a.m = m;
  a.p = params(c, K);
  a.workspace = token_ws_;
  a.workspace_bytes = token_ws_bytes_;
  a.stream = stream;

  if (ep.size() == 1) {
    // Every expert here: the one-rank MoE over the share.
    if (m > 0) moe::moe_forward(b.moe, a);
  } else if (decode_rows_ > 0) {
    DSV4_CHECK(n <= decode_rows_, "parallel MoE: a decode step of ", n, " rows, the world's ",
               decode_rows_);
    decode_exchange(b, xs, ts, a.shared, m, a.y, stream);
  } else {
    const int P = ep.size(), me = ep.rank(), El = b.moe_local.n_experts;
    DSV4_CHECK(El * P == E && b.experts_lo == me * El, "parallel MoE: rank ", me,
               " holds experts [", b.experts_lo, ", ", b.experts_lo + El, ")");
    // 1. Route and group by expert (a rank without rows has none of either).
    const moe::MoeWorkspace ws = moe::carve_moe_workspace(b.moe, m, K, token_ws_);
    if (m > 0) {
      a.stages = moe::kStageRoute | moe::kStagePlan;
      moe::moe_forward(b.moe, a);
    } else {
      DSV4_CUDA_CHECK(cudaMemsetAsync(ws.expert_first, 0, size_t(E + 1) * 4, stream));
    }
    // 2. Everyone's expert_first: the sizes of every exchange.
    ep.all_gather(ws.expert_first, first_all_, size_t(E + 1) * 4, stream);
    DSV4_CUDA_CHECK(cudaMemcpyAsync(host_first_, first_all_, size_t(P) * (E + 1) * 4,
                                    cudaMemcpyDeviceToHost, stream));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
    auto first = [&](int r, int e) { return host_first_[size_t(r) * (E + 1) + e]; };
    std::vector<size_t> send_rows(P), send_at(P), recv_rows(P), recv_at(P);
    size_t recv = 0;
    for (int o = 0; o < P; ++o) {
      send_at[o] = size_t(first(me, o * El));
      send_rows[o] = size_t(first(me, (o + 1) * El) - first(me, o * El));
      recv_at[o] = recv;
      recv_rows[o] = size_t(first(o, (me + 1) * El) - first(o, me * El));
      recv += recv_rows[o];
    }
    DSV4_CHECK(int64_t(recv) <= max_recv_, "parallel MoE: ", recv, " pairs arrive, planned ",
               max_recv_);
    // The arriving pairs' experts (local ids), in the senders' sorted order.
    size_t k = 0;
    for (int s = 0; s < P; ++s)
      for (int e = me * El; e < (me + 1) * El; ++e)
        for (int32_t j = first(s, e); j < first(s, e + 1); ++j) host_sel_[k++] = e - me * El;
    const int pairs = first(me, E);
    if (pairs > 0) glue::gather_rows(ws.xq, dim, ws.sorted_row, pairs, send_x_, stream);

    // 3. Dispatch: x rows and routing weights to the owners.
    const moe::MoeWorkspace ow = moe::carve_moe_workspace(b.moe_local, int(recv), 1, owner_ws_);
    auto scaled = [](std::vector<size_t> v, size_t unit) {
      for (size_t& e : v) e *= unit;
      return v;
    };
    const size_t row = size_t(dim) * 2;
    ep.all_to_all_v(send_x_, scaled(send_at, row), scaled(send_rows, row), ow.xq,
                    scaled(recv_at, row), scaled(recv_rows, row), stream);
    ep.all_to_all_v(ws.sorted_wt, scaled(send_at, 4), scaled(send_rows, 4), ow.wt,
                    scaled(recv_at, 4), scaled(recv_rows, 4), stream);
    // 4. The owner's experts over the arrivals, outputs back in arrival order.
    if (recv > 0) {
      DSV4_CUDA_CHECK(cudaMemcpyAsync(ow.sel, host_sel_, recv * 4, cudaMemcpyHostToDevice, stream));
      DSV4_CUDA_CHECK(cudaMemsetAsync(ow.counters, 0, 4 * 4, stream));
      moe::MoeArgs o;
      o.x = ow.xq;
      o.y = back_;
      o.m = int(recv);
      o.p = params(c, 1);
      o.workspace = owner_ws_;
      o.workspace_bytes = owner_ws_bytes_;
      o.stream = stream;
      o.stages = moe::kStagePlan | moe::kStageGateUp | moe::kStageQuantAct | moe::kStageDown;
      moe::moe_forward(b.moe_local, o);
      glue::gather_rows(ow.ye, dim, ow.pair_pos, int(recv), back_, stream);
    }
    // 5. Back to the senders, at the sorted positions their runs came from.
    ep.all_to_all_v(back_, scaled(recv_at, row), scaled(recv_rows, row), ws.ye,
                    scaled(send_at, row), scaled(send_rows, row), stream);
    if (m > 0) {
      a.stages = moe::kStageCombine;
      moe::moe_forward(b.moe, a);
    }
  }

  // 6. The group's ranks exchange their shares' rows.
  if (gs > 1) {
    std::vector<size_t> so(gs), sb(gs), ro(gs), rb(gs);
    for (int r = 0; r < gs; ++r) {
      const auto [rl, rh] = share(r);
      so[r] = size_t(lo) * dim * 2;
      sb[r] = r == gm ? 0 : size_t(m) * dim * 2;
      ro[r] = size_t(rl) * dim * 2;
      rb[r] = r == gm ? 0 : size_t(rh - rl) * dim * 2;
    }
    group.all_to_all_v(y, so, sb, y, ro, rb, stream);
  }
}

// The decode exchange (parallel_moe.h): every size is a capacity, so the enqueued work is the
// same for any routing and any row counts up to them.
void CudaParallelMoe::decode_exchange(const CudaBlockWeights& b, const bf16* xs, const int32_t* ts,
                                      const bf16* shared, int m, bf16* y, cudaStream_t stream) {
  const ModelConfig& c = cfg_;
  const int K = c.n_activated_experts, E = c.n_routed_experts, dim = c.dim;
  DeviceCommunicator& ep = *rank_.ep;
  const int P = ep.size(), me = ep.rank(), El = b.moe_local.n_experts;
  DSV4_CHECK(El * P == E && b.experts_lo == me * El, "parallel MoE: rank ", me, " holds experts [",
             b.experts_lo, ", ", b.experts_lo + El, ")");
  const int gs = rank_.group->size();
  const int cap = (decode_rows_ + gs - 1) / gs;
  DSV4_CHECK(m <= cap, "parallel MoE: a share of ", m, " rows, capacity ", cap);
  // 1. Route this rank's rows and pack them.
  const moe::MoeWorkspace ws = moe::carve_moe_workspace(b.moe, m, K, token_ws_);
  if (m > 0) {
    moe::MoeArgs a;
    a.x = xs;
    a.tokens = ts;
    a.y = y;  // unused by Route
    a.m = m;
    a.p = params(c, K);
    a.workspace = token_ws_;
    a.workspace_bytes = token_ws_bytes_;
    a.stream = stream;
    a.stages = moe::kStageRoute;
    moe::moe_forward(b.moe, a);
  }
  exchange::pack(ws.sel, ws.wt, ws.xq, m, K, dim, cap, slab_, stream);
  // 2. Everyone's slabs.
  ep.all_gather(slab_, slabs_, exchange::slab_bytes(cap, K, dim), stream);
  // 3. The owner's experts over its slots of every gathered row (at most min(top-k, El)
  // distinct ones per row), summed per row.
  const int rows = P * cap, Kl = std::min(K, El);
  const moe::MoeWorkspace ow = moe::carve_moe_workspace(b.moe_local, rows, Kl, owner_ws_);
  exchange::select(slabs_, P, cap, K, dim, me * El, El, Kl, ow.sel, ow.wt, ow.xq, stream);
  DSV4_CUDA_CHECK(cudaMemsetAsync(ow.counters, 0, 4 * 4, stream));
  moe::MoeArgs o;
  o.x = ow.xq;
  o.y = reinterpret_cast<bf16*>(partial_);  // unused (no Combine stage)
  o.m = rows;
  o.p = params(c, Kl);
  o.workspace = owner_ws_;
  o.workspace_bytes = owner_ws_bytes_;
  o.stream = stream;
  o.stages = moe::kStagePlan | moe::kStageGateUp | moe::kStageQuantAct | moe::kStageDown;
  // The token tile of the pairs an owner expects with balanced routing (cap x top-k over its
  // experts), not of its padded batch.
  const moe::MoeGemmChoice gc = moe::moe_gemm_choice(b.moe_local, cap, Kl);
  o.gemm_path = gc.path;
  o.tile_n = gc.tile_n;
  moe::moe_forward(b.moe_local, o);
  exchange::partial_sums(ow.sel, ow.pair_pos, rows, Kl, ow.ye, dim, partial_, stream);
  // 4. Each sender's rows' sums back to it, then its combine.
  const size_t slab = size_t(cap) * dim * 4;
  std::vector<size_t> at(size_t(P), 0);
  const std::vector<size_t> bytes(size_t(P), slab);
  for (int r = 0; r < P; ++r) at[size_t(r)] = size_t(r) * slab;
  ep.all_to_all_v(partial_, at, bytes, parts_, at, bytes, stream);
  exchange::finish(parts_, P, cap, m, shared, dim, y, stream);
}

}  // namespace dsv4
