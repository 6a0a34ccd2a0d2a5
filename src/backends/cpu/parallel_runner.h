// The CPU backend's parallel engine (issue: the parallel engine over NCCL; this is its
// reference): W ranks as threads of this process over the in-process communicator, each rank
// holding only its shard of the weights (cpu::WeightShard) and, per data-parallel group, its
// own copy of the group's caches (the ranks of a group compute the same KV: the latent is
// shared by every head). One BlockManager per group (PagedRunner) gives every rank of the group
// the same page ids. A step runs every rank at once; a group without work still takes part in
// the MoE exchanges with an empty batch. Logits and samples come from each group's first rank.
// Bit for bit the one-rank CPU backend (tests/parallel_test.cpp).
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backends/cpu/host_cache.h"
#include "backends/cpu/model.h"
#include "backends/cpu/rank_context.h"
#include "comm/communicator.h"
#include "model/paged_runner.h"
#include "model/parallel_layout.h"
#include "model/weights.h"

namespace dsv4 {

class ParallelCpuRunner final : public PagedRunner {
 public:
  // `cache`: each data-parallel group's pool.
  ParallelCpuRunner(const ModelConfig& config, const WeightsRef& weights,
                    const ParallelConfig& parallel, const CacheConfig& cache);
  ~ParallelCpuRunner() override;

  const ParallelLayout& layout() const { return layout_; }
  // Rank w's cache (for byte comparisons in tests).
  HostCache& cache(int w) { return *ranks_[size_t(w)].cache; }

 private:
  struct Rank {
    RankContext ctx;
    std::unique_ptr<Communicator> world, tp, group, ep;
    std::unique_ptr<CpuModel> model;
    std::unique_ptr<HostCache> cache;
  };
  void reset_states(int dp_rank, int slot) override;
  void copy_sequence(int dp_rank, const SequenceCache& from, const SequenceCache& to) override;
  void copy_pages(int dp_rank, const std::vector<PageCopy>& copies) override;
  StepOutput forward(const StepBatch& batch) override;
  std::vector<StepOutput> forward_groups(const std::vector<StepBatch>& batches) override;
  // Runs job(w) on every rank's thread and waits; rethrows the first failure.
  void run_all(const std::function<void(int)>& job);
  void worker(int w);

  ParallelLayout layout_;
  std::vector<Rank> ranks_;
  // The rank threads.
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t job_id_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
};

}  // namespace dsv4
