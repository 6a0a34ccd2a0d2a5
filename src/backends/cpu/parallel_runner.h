// The CPU backend's parallel engine (issue: the parallel engine over NCCL; this is its
// reference): W ranks as threads, each rank holding only its shard of the weights
// (cpu::WeightShard) and, per data-parallel group, its own copy of the group's caches (the
// ranks of a group compute the same KV: the latent is shared by every head). One BlockManager
// per group (PagedRunner) gives every rank of the group the same page ids. A step runs every
// rank at once; a group without work still takes part in the MoE exchanges with an empty
// batch. Logits come from each group's first rank. Bit for bit the one-rank CPU backend
// (tests/parallel_test.cpp).
//
// One node: every rank a thread of this process, over the in-process communicator. Several
// nodes (ParallelRunnerBase): this node's ranks as threads, over TCP between every pair of
// ranks (comm/tcp_communicator.h) — the same collectives, so the same bits
// (tests/multinode_test.py).
#pragma once

#include <memory>
#include <vector>

#include "backends/cpu/host_cache.h"
#include "backends/cpu/model.h"
#include "backends/cpu/parallel_base.h"
#include "backends/cpu/rank_context.h"
#include "comm/communicator.h"
#include "model/weights.h"

namespace dsv4 {

class ParallelCpuRunner final : public ParallelRunnerBase {
 public:
  // `cache`: each data-parallel group's pool.
  ParallelCpuRunner(const ModelConfig& config, const WeightsRef& weights,
                    const ParallelConfig& parallel, const CacheConfig& cache,
                    const NodePlacement& node = {});
  ~ParallelCpuRunner() override;

  // World rank w's cache, w on this node (for byte comparisons in tests).
  HostCache& cache(int w) { return *ranks_.at(size_t(w - first_rank())).cache; }

 private:
  struct Rank {
    RankContext ctx;
    std::unique_ptr<Communicator> world, tp, group, ep;
    std::unique_ptr<CpuModel> model;
    std::unique_ptr<HostCache> cache;
  };
  void rank_reset_states(int local, int slot) override;
  void rank_copy_sequence(int local, const SequenceCache& from, const SequenceCache& to) override;
  void rank_copy_pages(int local, const std::vector<PageCopy>& copies) override;
  void local_forward(const std::vector<StepBatch>& batches,
                     std::vector<GroupResult>& results) override;

  std::vector<Rank> ranks_;  // this node's, by local index
};

}  // namespace dsv4
