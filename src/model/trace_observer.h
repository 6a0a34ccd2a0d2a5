// Traces as an op observer: the CPU model's named intermediate tensors (model/trace.h) taken
// from the op events of a forward pass (either backend), per block and sequence chunk:
// hidden.in, attn_in, attn_out, ffn_in, ffn_out (sub-layer events), hidden.out (the MoE's
// hc_post), indexer.selected (each row ascending, -1 padded at the end, as the CPU traces it),
// indexer.scores (where the backend gives them), route.experts and route.weights.
#pragma once

#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

#include "model/op_event.h"
#include "model/trace.h"

namespace dsv4 {

class TraceObserver : public OpObserver {
 public:
  // `read` copies `bytes` from the backend's memory at `src` to the host (after the op's work
  // is complete); `hc` and `dim` shape stream rows [n, hc, dim].
  using Reader = std::function<void(void* dst, const void* src, size_t bytes)>;
  TraceObserver(TraceSink& sink, Reader read, int hc, int dim)
      : sink_(sink), read_(std::move(read)), hc_(hc), dim_(dim) {}

  void after(const OpEvent& e) override;

 private:
  // The rows of `t` (rows of its stride) per chunk (`chunk` >= 0: that chunk's alone), as
  // floats or ints.
  // streams: shaped [n, hc, dim].
  void floats(int block, const char* name, const TensorRef& t, int chunk, bool streams = false);
  void ints(int block, const char* name, const TensorRef& t, bool sort_rows, int chunk);
  std::vector<std::pair<int, int>> chunks_of(const TensorRef& t, int chunk) const;

  TraceSink& sink_;
  Reader read_;
  int hc_, dim_;
  std::vector<int> chunk_rows_;  // rows of each chunk of the current step
};

}  // namespace dsv4
