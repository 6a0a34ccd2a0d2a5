// CudaModel's part in the parallel engine: the rank's collectives (model.h: set_rank).
#include <algorithm>

#include "backends/cuda/model.h"
#include "backends/cuda/parallel_moe.h"
#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4 {

void CudaModel::set_rank(const CudaRankContext* rank) {
  DSV4_CHECK(!observer_, "the parallel engine runs without verify mode and traces");
  rank_ = rank;
  pmoe_.reset();
  tp_mine_ = tp_all_ = nullptr;
  if (!rank) return;
  DSV4_CHECK(rank->layout && rank->tp && rank->group && rank->ep,
             "CUDA model: a rank without its communicators");
  const int tp = rank->tp->size();
  if (tp > 1) {
    // The widest slab gathered: this rank's wo_a outputs or indexer heads.
    int64_t width = 0;
    for (const CudaBlockWeights& b : w_.blocks) {
      width = std::max<int64_t>(width, b.wo_a.n);
      width = std::max<int64_t>(width, b.index_wq_b.n);
    }
    const size_t bytes = size_t(limits_.max_tokens) * size_t(width) * 2;
    tp_mine_ = reinterpret_cast<__nv_bfloat16*>(ctx_.allocate(bytes));
    tp_all_ = reinterpret_cast<__nv_bfloat16*>(ctx_.allocate(bytes * size_t(tp)));
  }
  if (rank->ep->size() > 1 || rank->group->size() > 1)
    pmoe_ = std::make_unique<CudaParallelMoe>(ctx_, cfg_, w_, *rank, limits_.max_tokens,
                                              limits_.max_seqs, act_.moe_ws, act_.moe_ws_bytes);
}

void CudaModel::set_decode_rows(int rows) {
  if (pmoe_) pmoe_->set_decode_rows(rows);
}

void CudaModel::idle_forward() {
  if (!pmoe_) return;  // nothing this rank exchanges
  for (int b = 0; b < cfg_.n_layers; ++b)
    pmoe_->forward(w_.blocks[size_t(b)], nullptr, nullptr, nullptr, 0, nullptr, stream_);
}

void CudaModel::tp_gather(const __nv_bfloat16* mine, int rows, int width, __nv_bfloat16* out) {
  DSV4_CHECK(rank_ && rank_->tp && tp_all_, "heads are split but the model has no tp group");
  DeviceCommunicator& tp = *rank_->tp;
  const int n = tp.size();
  const size_t slab = size_t(rows) * size_t(width);
  tp.all_gather(mine, tp_all_, slab * 2, stream_);
  // [rank][row][width] -> [row][rank][width]
  for (int r = 0; r < n; ++r)
    DSV4_CUDA_CHECK(cudaMemcpy2DAsync(
        out + size_t(r) * width, size_t(n) * width * 2, tp_all_ + size_t(r) * slab,
        size_t(width) * 2, size_t(width) * 2, size_t(rows), cudaMemcpyDeviceToDevice, stream_));
}

}  // namespace dsv4
