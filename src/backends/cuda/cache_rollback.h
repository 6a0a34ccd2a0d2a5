// Speculative decoding's rollback on the device: the cache stores a step will overwrite
// (model/speculation.h's for_each_span_store: window slots, the compressed entries and
// indexer keys the positions complete, the compressor states) are copied device to device
// into a save area planned up front, and copied back for the sequences whose drafts were
// rejected. Each batch of copies is one upload of a segment list (pinned, adjacent ranges
// merged) and one kernel launch; no host round trip per token or per store.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "backends/cuda/device_cache.h"
#include "backends/cuda/glue.h"
#include "model/model_config.h"
#include "model/speculation.h"
#include "ops/cuda/common/device_buffer.h"

namespace dsv4 {

class CacheRollback {
 public:
  // Room for, per sequence, one span of `main_positions` positions over the decoder blocks and
  // one of `mtp_positions` over the MTP block(s) (rollback_bound, model/speculation.h: the
  // memory plan counts the same bytes).
  CacheRollback(const ModelConfig& model, int seqs, int main_positions, int mtp_positions);
  ~CacheRollback();
  CacheRollback(const CacheRollback&) = delete;
  CacheRollback& operator=(const CacheRollback&) = delete;

  // Forgets every saved span (the previous batch's copies must have completed: the runner
  // synchronises its stream per step).
  void reset();
  // Queues the save of `span` of sequence `s`; returns its handle.
  int save(DeviceCache& cache, const SequenceCache& s, const CacheSpan& span);
  // Enqueues the queued saves on `stream`.
  void flush(cudaStream_t stream);
  // A step's saves as part of a CUDA graph: the first saves since reset() padded with empty
  // segments to `segments` (a graph's fixed launch; at least the queued count), so that
  // flush() enqueues one copy of the segment list from a fixed pinned address and one kernel
  // over a fixed count — what a capture records and a replay repeats with this step's list.
  void pad_saves(size_t segments);
  // The queued saves were enqueued by a graph replay (their flush() was captured earlier).
  void flushed_by_graph() { flushed_ = count_; }
  // Enqueues the copy back of the saved spans `handles` on `stream`.
  void restore(const std::vector<int>& handles, cudaStream_t stream);
  // Rollback::kRestore: enqueues the copy back of only what the positions after the first
  // `kept` of each saved span changed (for_each_rejected_store, model/speculation.h).
  struct Rejected {
    int handle = -1;
    const SequenceCache* seq = nullptr;
    CacheSpan span;  // as saved
    int kept = 0;
  };
  void restore_rejected(DeviceCache& cache, const std::vector<Rejected>& spans,
                        cudaStream_t stream);

 private:
  // Appends a segment (merged with the last when both ranges continue it) to the list.
  void add(const uint8_t* src, uint8_t* dst, int64_t bytes);
  // Uploads segments [from, count_) and launches their copy.
  void launch(size_t from, cudaStream_t stream);

  const ModelConfig& model_;
  int64_t used_ = 0;       // save-area bytes taken since reset()
  size_t flushed_ = 0;     // segments already launched
  size_t count_ = 0;       // segments in the list
  size_t save_first_ = 0;  // the first segment of the span being saved
  size_t capacity_ = 0;
  struct Saved {
    size_t first, last;  // segment range
  };
  std::vector<Saved> saved_;
  cuda::DeviceBuffer<uint8_t> area_;
  glue::CopySegment* host_ = nullptr;  // pinned [capacity_]
  cuda::DeviceBuffer<glue::CopySegment> device_;
};

}  // namespace dsv4
