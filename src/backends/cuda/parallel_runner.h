// The CUDA backend's parallel engine, the twin of ParallelCpuRunner: W ranks, one thread each,
// each with its own DeviceContext (stream, cuBLAS handle, arena), a CudaModel built from only
// its shard of the weights (upload_cuda_weights with the rank's cpu::WeightShard) and, per
// data-parallel group, its own copy of the group's device caches (the ranks of a group compute
// the same KV). One BlockManager per group (PagedRunner) gives every rank of a group the same
// page ids. A step runs every rank at once; a group without work still joins the MoE exchanges
// with an empty batch (CudaModel::idle_forward). Logits and samples come from each group's
// first rank.
//
// The same code runs over either communicator:
//  - kInProcess: every rank on one GPU (`device`), collectives by cudaMemcpyAsync between the
//    ranks' buffers (comm/inproc_device_communicator.h) — a test and development facility,
//    so the parallel forward is compared with one rank without several GPUs;
//  - kNccl: rank w on GPU w of this process (one thread per GPU), NCCL collectives.
// Several nodes (ParallelRunnerBase): a process per node, a thread per local GPU (rank w on
// local GPU w - first_rank()), NCCL across all; the unique id goes from node 0 to the others
// through the rendezvous. The in-process communicator is one node only.
// CUDA graphs (ParallelCudaOptions::cuda_graphs): decode steps, keyed like CudaRunner's. A
// step is a decode step for the whole world when every dp group's batch is empty or one token
// per sequence; then every rank sets the MoE's decode exchange (parallel_moe.h: fixed capacity,
// counts on the device, nothing through the host) for D rows per group, D = the largest group's
// batch padded to the next graph size (the same on every rank: each node sees every group's
// batch). With graphs on, each busy group pads its batch to its next graph size with dummy rows
// of a scratch sequence (CudaRunner's rule) and every rank runs its step as a graph keyed by
// (its padded batch, D, its group's context bucket) — an idle rank's MoE exchanges too, keyed by
// (0, D). Eager or graph is decided for the whole world per step (the in-process communicator's
// eager collectives meet on the host, its captured ones do not): the first step of each world
// shape (every group's padded batch and bucket, and D) runs eagerly with the graphs' shapes (it
// sets the kernels' attributes), the later ones capture what a rank has not captured yet and
// replay the rest, each graph launch between two launch_barrier()s. Replays and eager steps of
// the same shapes give the same bits (with bucket_eager_decode). Graphs stay off whenever an
// op observer watches a rank's model. Prefill and mixed steps run eagerly with the host-sized
// MoE exchange. Verify mode is not offered.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

#include "backends/cpu/parallel_base.h"
#include "backends/cuda/device_cache.h"
#include "backends/cuda/device_context.h"
#include "backends/cuda/model.h"
#include "backends/cuda/rank_context.h"
#include "backends/cuda/step.h"
#include "comm/device_communicator.h"
#include "model/weights.h"

namespace dsv4 {

enum class CudaCommKind { kInProcess, kNccl };

struct ParallelCudaOptions {
  CudaCommKind comm = CudaCommKind::kNccl;
  int device = 0;  // kInProcess: the GPU every rank runs on
  // Decode steps as CUDA graphs, as CudaRunnerOptions.
  bool cuda_graphs = false;
  std::set<int> graph_batch_sizes = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  bool pad_to_graph_sizes = true;
  bool bucket_eager_decode = false;
  // kNccl: how long each rank's NCCL set-up (the world's init, each split) may take before it
  // fails naming the rank that waited (NcclSetup::timeout_s). The ranks enter it together (on
  // several nodes after every node confirmed), so it only covers NCCL's own work.
  double nccl_setup_timeout_s = 300;
};

class ParallelCudaRunner final : public ParallelRunnerBase {
 public:
  // `limits`: each rank's model (a dp group's largest step); `cache`: each group's pool.
  ParallelCudaRunner(const ModelConfig& config, const WeightsRef& weights,
                     const ParallelConfig& parallel, const CacheConfig& cache,
                     const CudaModelLimits& limits, const ParallelCudaOptions& options,
                     const NodePlacement& node = {});
  ~ParallelCudaRunner() override;

  // World rank w's model and cache, w on this node (tests).
  CudaModel& model(int w) { return *ranks_.at(size_t(w - first_rank())).model; }
  DeviceCache& cache(int w) { return *ranks_.at(size_t(w - first_rank())).cache; }
  // World rank w's graphs captured and replayed so far (w on this node).
  int graphs_captured(int w) const {
    return int(ranks_.at(size_t(w - first_rank())).graphs.size());
  }
  int64_t graph_replays(int w) const { return ranks_.at(size_t(w - first_rank())).replays; }
  // Steps run as graphs (every rank's captured or replayed) and decode steps padded for them.
  int64_t graph_steps() const { return graph_steps_; }
  int64_t padded_steps() const { return padded_steps_; }

 private:
  // (padded batch, D, bucket) of one rank's graph.
  using GraphKey = std::tuple<int, int, int64_t>;
  struct Graph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
  };
  struct Rank {
    CudaRankContext ctx;
    std::unique_ptr<DeviceCommunicator> world, tp, group, ep;
    std::unique_ptr<DeviceContext> device;
    std::unique_ptr<CudaModel> model;
    std::unique_ptr<DeviceCache> cache;
    std::unique_ptr<StepBuffers> meta;
    float* host_logits = nullptr;  // pinned [max_logit_rows, vocab] (a group's first rank)
    SequenceCache scratch;         // the padding rows' sequence (the cache's extra sequence 0)
    std::map<GraphKey, Graph> graphs;
    int64_t replays = 0;
  };
  // How the world runs one step (the same on every rank and node).
  struct StepPlan {
    int decode_rows = 0;           // D: > 0 for a decode step (the MoE's decode exchange)
    bool graphs = false;           // eager, or every rank's graph
    std::vector<int> rows;         // per group: the batch it runs (padded), 0 idle
    std::vector<int64_t> buckets;  // per group: its context bucket (decode steps)
  };
  StepPlan plan_step(const std::vector<StepBatch>& batches);
  // The batch size a decode step of n sequences runs as with graphs (n or a padded size), or 0.
  int graph_size(int n) const;
  // Rank l's part of a graph step: replays its graph, or captures and launches it.
  void run_graph(int l, const GraphKey& key, const std::function<void()>& forward);
  void destroy_graphs(Rank& r);
  // After a step's stream completed: the failures its collectives could not report at the call
  // (DeviceCommunicator::check_completed).
  void check_collectives(Rank& r);
  void rank_reset_states(int local, int slot) override;
  void rank_copy_sequence(int local, const SequenceCache& from, const SequenceCache& to) override;
  void rank_copy_pages(int local, const std::vector<PageCopy>& copies) override;
  void local_forward(const std::vector<StepBatch>& batches,
                     std::vector<GroupResult>& results) override;
  // Frees every rank's device objects on its thread, then stops the ranks (and the other
  // nodes, from node 0).
  void shutdown();

  ParallelCudaOptions opt_;
  std::vector<Rank> ranks_;  // this node's, by local index
  // Guards the ranks' communicator pointers: a failing rank aborts the others' from its thread.
  std::mutex comms_mu_;
  // Set when a rank failed or another node did (RankPool's failure hook): cancels the NCCL
  // set-ups in flight (NcclSetup::cancelled), which abort() cannot reach (no communicator yet).
  std::atomic<bool> setup_cancelled_{false};
  std::vector<int> devices_;  // per local rank
  // World shapes seen (the first runs eagerly): D, then each group's (rows, bucket).
  std::map<std::vector<int64_t>, int> seen_;
  int64_t graph_steps_ = 0, padded_steps_ = 0;
};

}  // namespace dsv4
