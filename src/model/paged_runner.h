// What both backends' runners share: the sequence table and page bookkeeping over one
// BlockManager, and the validation of a step before it touches any state. A backend supplies
// the bytes (state resets, copies for forks and copy-on-write) and the forward pass.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "kvcache/block_manager.h"
#include "model/runner.h"
#include "model/step.h"

namespace dsv4 {

class PagedRunner : public Runner {
 public:
  struct Limits {
    int max_step_tokens = 1 << 30;
    int max_step_seqs = 1 << 30;
    int64_t max_context = int64_t(1) << 40;  // capped by max_position_embeddings
    int max_logit_rows = 1 << 30;            // logits rows (wanted or sampled) per step
  };

  const ModelConfig& config() const override { return cfg_; }
  int max_step_tokens() const override { return lim_.max_step_tokens; }
  int max_step_seqs() const override { return lim_.max_step_seqs; }
  int64_t max_context() const override { return lim_.max_context; }
  int max_logit_rows() const override { return lim_.max_logit_rows; }

  int open_sequence() override;
  int fork_sequence(int src) override;
  void close_sequence(int seq) override;
  int64_t length(int seq) const override;
  bool can_open() const override { return blocks_.can_begin(); }
  bool can_append(int seq, int64_t n) const override;
  int64_t pages_to_append(int seq, int64_t n, PageKind k) const override {
    return blocks_.pages_to_append(sequence(seq), n, k);
  }
  const CacheSpec& cache_spec() const override { return blocks_.spec(); }
  int page_size() const override { return blocks_.config().page_size; }
  CacheUsage usage() const override;
  CacheUsage usage_excluding(const std::vector<int>& seqs) const override;
  StepOutput step(const std::vector<StepInput>& inputs) override;

  const BlockManager& blocks() const { return blocks_; }
  SequenceCache& sequence(int seq);
  const SequenceCache& sequence(int seq) const;

 protected:
  PagedRunner(const ModelConfig& config, const CacheConfig& cache, const Limits& limits);

  // A fresh sequence's compressor states (kv 0, score -inf).
  virtual void reset_states(int slot) = 0;
  // `to` continues where `from` stands: window pages and compressor states copied.
  virtual void copy_sequence(const SequenceCache& from, const SequenceCache& to) = 0;
  // Copy-on-write: every layer's bytes of each page.
  virtual void copy_pages(const std::vector<PageCopy>& copies) = 0;
  // The forward pass of a validated batch whose pages are reserved; logits of rows
  // [0, num_logit_rows) and the samples.
  virtual StepOutput forward(const StepBatch& batch) = 0;

  const Limits& limits() const { return lim_; }

 private:
  StepBatch prepare(const std::vector<StepInput>& inputs);
  // The token rows (0 .. tokens - 1) of an input whose logits the step computes.
  static std::set<int> rows_of(const StepInput& in);

  ModelConfig cfg_;
  Limits lim_;
  BlockManager blocks_;
  std::map<int, SequenceCache> seqs_;
  int next_id_ = 0;
};

}  // namespace dsv4
