// Runs batches of sequences through the CUDA model, as CpuRunner does on the CPU: owns the
// block manager (the same page bookkeeping), the device cache pool and the sequences' block
// tables. One step takes any mix of prefill chunks and decode tokens, one contiguous run of
// tokens per sequence; the step's metadata (positions, block tables of the three page kinds,
// state slots, logit rows) is built on the host and uploaded in one go.
//
// Decode steps (every sequence one token) of the batch sizes in `graph_batch_sizes` are
// captured as CUDA graphs, one per (batch size, context bucket): the launch bounds of a graph
// use the bucket's end (the next power of two >= 1024 of the longest sequence) as the largest
// position, so one graph serves every step whose positions fall in the bucket. The first step
// of a (size, bucket) runs eagerly (it also sets the kernels' function attributes), the second
// captures, later ones replay. Graph replay and eager runs give the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "model/cuda_cache.h"
#include "model/cuda_model.h"
#include "model/cuda_step.h"
#include "runtime/block_manager.h"
#include "runtime/cpu_runner.h"  // StepInput

namespace dsv4 {

class CudaVerifier;

struct CudaRunnerOptions {
  bool cuda_graphs = true;
  std::set<int> graph_batch_sizes = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  // Eager decode steps size their launches with the same bucketed position bound as graphs
  // (so an eager run and a graph replay compute the same bits; tests compare them).
  bool bucket_eager_decode = false;
};

class CudaRunner {
 public:
  CudaRunner(CudaModel& model, const CacheConfig& cache, const CudaRunnerOptions& options = {});
  ~CudaRunner();

  // Throws dsv4::Error when no sequence slot or window pages are free.
  int open_sequence();
  void close_sequence(int seq);
  int64_t length(int seq) const;

  // Logits rows in input order: per input, tokens.size() rows if all_logits else 1.
  // Validates token ids, lengths and cache room before touching any state; throws dsv4::Error.
  std::vector<float> step(const std::vector<StepInput>& inputs);

  // Verify mode (graphs off while it is set); null turns it off.
  void set_verifier(CudaVerifier* v);

  DeviceCache& cache() { return cache_; }
  const BlockManager& blocks() const { return blocks_; }
  SequenceCache& sequence(int seq);
  CudaModel& model() { return model_; }
  int graphs_captured() const { return int(graphs_.size()); }
  int64_t graph_replays() const { return replays_; }

 private:
  struct Graph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
  };
  std::vector<ChunkRef> prepare(const std::vector<StepInput>& inputs, std::vector<int>* logit_rows);
  void run_graph(const std::vector<ChunkRef>& chunks, const std::vector<int>& rows);
  int64_t bucket(const std::vector<ChunkRef>& chunks) const;

  CudaModel& model_;
  BlockManager blocks_;
  DeviceCache cache_;
  StepBuffers meta_;
  CudaRunnerOptions opt_;
  std::map<int, SequenceCache> seqs_;
  int next_id_ = 0;
  CudaVerifier* verify_ = nullptr;
  std::map<std::pair<int, int64_t>, int> seen_;  // (batch, bucket) -> eager runs
  std::map<std::pair<int, int64_t>, Graph> graphs_;
  int64_t replays_ = 0;
};

// The cache pool for `max_seqs` sequences of up to `max_context` tokens (`budget_bytes` <= 0),
// or one of exactly `budget_bytes` (window pages for max_seqs sequences, the rest shared by the
// C4 and C128 stores in the model's per-token proportion). Throws when the window pages alone
// do not fit.
CacheConfig plan_cache(const ModelConfig& c, int max_seqs, int64_t max_context, int page_size,
                       int64_t budget_bytes);

}  // namespace dsv4
