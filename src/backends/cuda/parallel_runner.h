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
// Eager only: no CUDA graphs (the MoE exchange sizes go through the host every layer, and the
// in-process collectives meet on the host). Verify mode is not offered either.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backends/cuda/device_cache.h"
#include "backends/cuda/device_context.h"
#include "backends/cuda/model.h"
#include "backends/cuda/rank_context.h"
#include "backends/cuda/step.h"
#include "comm/device_communicator.h"
#include "model/paged_runner.h"
#include "model/parallel_layout.h"
#include "model/weights.h"

namespace dsv4 {

enum class CudaCommKind { kInProcess, kNccl };

struct ParallelCudaOptions {
  CudaCommKind comm = CudaCommKind::kNccl;
  int device = 0;  // kInProcess: the GPU every rank runs on
};

class ParallelCudaRunner final : public PagedRunner {
 public:
  // `limits`: each rank's model (a dp group's largest step); `cache`: each group's pool.
  ParallelCudaRunner(const ModelConfig& config, const WeightsRef& weights,
                     const ParallelConfig& parallel, const CacheConfig& cache,
                     const CudaModelLimits& limits, const ParallelCudaOptions& options);
  ~ParallelCudaRunner() override;

  const ParallelLayout& layout() const { return layout_; }
  // Rank w's model and cache (tests).
  CudaModel& model(int w) { return *ranks_[size_t(w)].model; }
  DeviceCache& cache(int w) { return *ranks_[size_t(w)].cache; }

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
  void reset_states(int dp_rank, int slot) override;
  void copy_sequence(int dp_rank, const SequenceCache& from, const SequenceCache& to) override;
  void copy_pages(int dp_rank, const std::vector<PageCopy>& copies) override;
  StepOutput forward(const StepBatch& batch) override;
  std::vector<StepOutput> forward_groups(const std::vector<StepBatch>& batches) override;
  // Runs job(w) on every rank's thread (its device current) and waits; rethrows the first
  // failure (a failing rank aborts the world communicator, so the others do not wait on it).
  void run_all(const std::function<void(int)>& job);
  void worker(int w);
  // Frees every rank's device objects on its thread, then joins the threads.
  void shutdown();

  ParallelLayout layout_;
  ParallelCudaOptions opt_;
  std::vector<Rank> ranks_;
  std::vector<int> devices_;  // per rank
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
