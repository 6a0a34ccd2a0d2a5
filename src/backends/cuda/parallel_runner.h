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
// Eager only: no CUDA graphs (the MoE exchange sizes go through the host every layer, and the
// in-process collectives meet on the host). Verify mode is not offered either.
#pragma once

#include <memory>
#include <mutex>
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

 private:
  struct Rank {
    CudaRankContext ctx;
    std::unique_ptr<DeviceCommunicator> world, tp, group, ep;
    std::unique_ptr<DeviceContext> device;
    std::unique_ptr<CudaModel> model;
    std::unique_ptr<DeviceCache> cache;
    std::unique_ptr<StepBuffers> meta;
    float* host_logits = nullptr;  // pinned [max_logit_rows, vocab] (a group's first rank)
  };
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
  std::vector<int> devices_;  // per local rank
};

}  // namespace dsv4
