// What every runner shares: the sequence table and page bookkeeping (one BlockManager per
// data-parallel group: a single backend has one group, the parallel engine one per dp rank,
// each with its own caches), and the validation of a step before it touches any state. A
// backend supplies the bytes (state resets, copies for forks and copy-on-write) and the
// forward pass.
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
  // Per data-parallel group.
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

  int dp_size() const override { return int(groups_.size()); }
  int dp_rank(int seq) const override;
  int open_sequence_on(int dp_rank) override;
  int fork_sequence(int src) override;
  void close_sequence(int seq) override;
  int64_t length(int seq) const override;
  bool can_open_on(int dp_rank) const override;
  bool can_append(int seq, int64_t n) const override;
  int64_t pages_to_append(int seq, int64_t n, PageKind k) const override;
  const CacheSpec& cache_spec() const override { return groups_[0].blocks.spec(); }
  int page_size() const override { return groups_[0].blocks.config().page_size; }
  CacheUsage usage_on(int dp_rank) const override;
  CacheUsage usage_excluding(const std::vector<int>& seqs) const override;
  StepOutput step(const std::vector<StepInput>& inputs) override;

  const BlockManager& blocks(int dp_rank = 0) const { return groups_.at(size_t(dp_rank)).blocks; }
  SequenceCache& sequence(int seq);
  const SequenceCache& sequence(int seq) const;
  // A new sequence in `src`'s group at `src`'s length that owns a copy of everything `src`
  // holds: its own compressed pages (every layer's KV and indexer keys copied), window pages
  // and compressor states. Unlike fork_sequence(), no page is shared, so a batch of clones reads
  // as many bytes as a batch of distinct sequences (benchmarks fill a batch's caches from one
  // prefilled sequence this way). Throws, changing nothing, when the pool lacks the pages.
  int clone_sequence(int src);

 protected:
  PagedRunner(const ModelConfig& config, const CacheConfig& cache, const Limits& limits,
              int dp_groups = 1);

  // A fresh sequence's compressor states (kv 0, score -inf), in group `dp_rank`'s caches.
  virtual void reset_states(int dp_rank, int slot) = 0;
  // `to` continues where `from` stands: window pages and compressor states copied.
  virtual void copy_sequence(int dp_rank, const SequenceCache& from, const SequenceCache& to) = 0;
  // Copy-on-write: every layer's bytes of each page.
  virtual void copy_pages(int dp_rank, const std::vector<PageCopy>& copies) = 0;
  // The forward pass of one group's validated batch whose pages are reserved: logits of rows
  // [0, num_logit_rows), the samples, scores and errors.
  virtual StepOutput forward(const StepBatch& batch) = 0;
  // Every group's batch of a step (a group without work has an empty batch). The default runs
  // the non-empty ones through forward(); the parallel engine runs all groups at once.
  virtual std::vector<StepOutput> forward_groups(const std::vector<StepBatch>& batches);

  const Limits& limits() const { return lim_; }

 private:
  struct Group {
    BlockManager blocks;
    std::map<int, SequenceCache> seqs;
  };
  StepBatch prepare(int group, const std::vector<const StepInput*>& inputs);
  // The token rows (0 .. tokens - 1) of an input whose logits the step computes.
  static std::set<int> rows_of(const StepInput& in);
  Group& group_of(int seq);
  const Group& group_of(int seq) const;

  ModelConfig cfg_;
  Limits lim_;
  std::vector<Group> groups_;
  std::map<int, int> seq_group_;  // sequence id -> group
  int next_id_ = 0;
};

}  // namespace dsv4
