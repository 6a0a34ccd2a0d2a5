// What the CPU and CUDA parallel runners share: the layout, this process's ranks as threads
// (comm/rank_pool.h), the per-group cache operations fanned out to the ranks of the group, and
// the multi-node control plane.
//
// Multi-node: one process per node, a thread per local rank (ranks [node * W / nnodes,
// (node + 1) * W / nnodes)). Node 0 is the engine: it owns the sequences, the pages and the
// scheduler, and posts every operation that touches the ranks (state resets, fork and
// copy-on-write copies, steps) to the other nodes over the rendezvous' connections before
// running its own ranks; the other nodes apply them in the same order (follow()). A step's
// description is small (page ids, positions, tokens); the tensors move over the ranks' own
// communicators. After a step, every node sends node 0 the logits rows of the groups whose
// first rank it holds (node 0 samples), or the error that stopped it. While the ranks run,
// node 0 watches the others (and they watch node 0): an error answer or a closed connection
// aborts this node's communicators, so its ranks leave their collectives (NCCL's too) and the
// step fails naming the node; a node silent past the rendezvous timeout after node 0's ranks
// finished fails it too. A failed step (or a lost node) is fatal: the step and every later
// operation throw EngineFailed (the ranks' communicators are aborted for good).
// Node 0's runner, when destroyed after the start check
// (nodes_started()), tells the others to stop.
//
// It lives in backends/cpu because both backends may include this folder (the layer map).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/rank_pool.h"
#include "model/node_wire.h"
#include "model/paged_runner.h"
#include "model/parallel_layout.h"

namespace dsv4 {

class Rendezvous;

struct NodePlacement {
  int nnodes = 1, node_rank = 0;
  std::shared_ptr<Rendezvous> rendezvous;  // nnodes > 1
};

class ParallelRunnerBase : public PagedRunner {
 public:
  const ParallelLayout& layout() const { return layout_; }
  // This process's ranks: world ranks [first_rank(), first_rank() + local_ranks()).
  int first_rank() const { return first_rank_; }
  int local_ranks() const { return local_ranks_; }
  int nnodes() const { return node_.nnodes; }
  void follow() override;
  void nodes_started() override;

 protected:
  // Checks the node placement against the layout (throws dsv4::Error naming the problem).
  ParallelRunnerBase(const ModelConfig& config, const CacheConfig& cache, const Limits& limits,
                     const ParallelConfig& parallel, const NodePlacement& node);
  ~ParallelRunnerBase() override;

  Rendezvous* rendezvous() { return node_.rendezvous.get(); }
  // Starts the rank threads (RankPool's hooks, on local rank indices).
  void start_ranks(std::function<void(int)> enter, std::function<void(int)> failed);
  // job(local rank) on every local rank's thread (during a multi-node step, while watching the
  // other nodes: one that fails or goes away aborts this node's ranks, so none waits forever
  // in a collective — NCCL's included).
  void run_ranks(const std::function<void(int)>& job) { pool_->run_all(job, watch_); }
  // Node 0: tells the other nodes to stop (they return from follow()). Then joins the rank
  // threads. A derived destructor calls it before its ranks' members go.
  void stop_ranks();

  // One local rank's share of the group operations.
  virtual void rank_reset_states(int local, int slot) = 0;
  virtual void rank_copy_sequence(int local, const SequenceCache& from,
                                  const SequenceCache& to) = 0;
  virtual void rank_copy_pages(int local, const std::vector<PageCopy>& copies) = 0;
  // Runs every local rank on its group's batch (empty: the group is idle but joins the
  // exchanges); fills results[g] for each group whose first rank is local.
  virtual void local_forward(const std::vector<StepBatch>& batches,
                             std::vector<GroupResult>& results) = 0;

  // World rank of group g's first rank (the one that computes its logits).
  int group_leader(int g) const { return g * layout_.config().tp; }
  bool is_local(int w) const { return w >= first_rank_ && w < first_rank_ + local_ranks_; }

 private:
  void reset_states(int dp_rank, int slot) override;
  void copy_sequence(int dp_rank, const SequenceCache& from, const SequenceCache& to) override;
  void copy_pages(int dp_rank, const std::vector<PageCopy>& copies) override;
  StepOutput forward(const StepBatch& batch) override;
  std::vector<StepOutput> forward_groups(const std::vector<StepBatch>& batches) override;

  // The group operations on this node's ranks.
  void local_reset_states(int g, int slot);
  void local_copy_sequence(int g, const SequenceCache& from, const SequenceCache& to);
  void local_copy_pages(int g, const std::vector<PageCopy>& copies);
  // Node 0 with other nodes: sends them `message`.
  void post(std::vector<uint8_t> message);
  // A failed step or post leaves the ranks aborted (or the nodes out of step): records why
  // and throws EngineFailed, now and on every later operation (check_usable()).
  [[noreturn]] void give_up(const std::string& why);
  void check_usable() const;
  bool leads_nodes() const { return node_.nnodes > 1 && node_.node_rank == 0; }

  ParallelLayout layout_;
  NodePlacement node_;
  int first_rank_ = 0, local_ranks_ = 0;
  std::unique_ptr<RankPool> pool_;
  std::function<void()> watch_;  // multi-node: set while the ranks are built, and during a step
  bool build_aborted_ = false;
  bool stopped_ = false, nodes_started_ = false;
  std::string failed_;  // why the runner gave up (give_up()); empty while usable
};

}  // namespace dsv4
