// The CUDA backend's runner: the CUDA model over a device cache pool in the shared byte
// layout (DeviceCache), with the page bookkeeping of PagedRunner. A step's metadata
// (positions, block tables of the three page kinds, state slots, logit rows) is built on the
// host and uploaded in one go.
//
// Decode steps (every sequence one token) of the batch sizes in `graph_batch_sizes` are
// captured as CUDA graphs, one per (batch size, context bucket); a decode step of another size
// is padded to the next captured size that the step limits allow, with dummy rows of a scratch
// sequence (its own state slot and window pages beyond the pool's, always at position 0:
// nothing a real sequence reads; their logits rows are never downloaded). The launch bounds of a
// graph use the bucket's end (the next power of two >= 1024 of the longest sequence) as the largest
// position, so one graph serves every step whose positions fall in the bucket. The first step
// of a (size, bucket) runs eagerly (it also sets the kernels' function attributes), the second
// captures, later ones replay. Graph replay and eager runs give the same bits.
//
// Speculative decoding (enable_speculation(); model/speculation.h for the shared rules): a
// verify's k + 1 tokens run as one chunk through the real kernels (eagerly: verify steps are
// not captured; plain decode steps keep their graphs, the MTP block's runs after them are
// eager), every row sampled at once on the device (row j with the drafts before it in its
// penalty history, model/speculation.h), acceptance decided on the host from the ids. Before
// the step, the stores a verify overwrites are saved device to device (CacheRollback); a
// sequence with rejected drafts gets them back and its kept tokens run again as one chunk,
// whose streams then feed the MTP block. Drafts: the MTP block on the device, chained, its
// greedy choice drawn by the device sampler; its ring slots restored after drafting.
//
// Samples and scores are drawn on the device (ops/cuda/sampling: the rules of
// ops/common/sampling.h, the ids of the reference sampler); only their results come back, and
// the logits rows the step asks for, each with one copy into pinned buffers planned for the
// largest step, then one synchronisation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "backends/cpu/weights.h"
#include "backends/cuda/device_cache.h"
#include "backends/cuda/model.h"
#include "backends/cuda/step.h"
#include "model/paged_runner.h"
#include "model/speculation.h"
#include "ops/cuda/sampling/device_sampler.h"

namespace dsv4 {

class CudaVerifier;

struct CudaRunnerOptions {
  bool cuda_graphs = true;
  std::set<int> graph_batch_sizes = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  bool pad_to_graph_sizes = true;  // other decode sizes: padded to the next captured one
  // Eager decode steps size their launches with the same bucketed position bound as graphs
  // (so an eager run and a graph replay compute the same bits; tests compare them).
  bool bucket_eager_decode = false;
};

class CudaRunner final : public PagedRunner {
 public:
  CudaRunner(CudaModel& model, const CacheConfig& cache, const CudaRunnerOptions& options = {});
  ~CudaRunner() override;

  // Verify mode (graphs off while it is set); null turns it off.
  void set_verifier(CudaVerifier* v);
  std::string report() const override;
  // Keeps the logits vector's storage for the next step's logits.
  void recycle(StepOutput&& used) override;

  // What a runner opened from a model directory keeps alive: the context, the model, and in
  // verify mode the CPU weights and the verifier (destroyed in reverse order).
  struct Owned {
    Owned();
    ~Owned();
    std::unique_ptr<DeviceContext> context;
    std::unique_ptr<CudaModel> model;
    cpu::ModelWeights cpu_weights;
    std::unique_ptr<CudaVerifier> verifier;
  };
  void adopt(std::unique_ptr<Owned> owned);

  void enable_speculation() override;
  bool speculation_enabled() const override { return spec_ != nullptr; }

  DeviceCache& cache() { return cache_; }
  CudaModel& model() { return model_; }
  int graphs_captured() const { return int(graphs_.size()); }
  int64_t graph_replays() const { return replays_; }
  int64_t padded_steps() const { return padded_; }

 private:
  struct Graph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
  };
  void reset_states(int, int slot) override { cache_.reset_states(slot, model_.stream()); }
  void copy_sequence(int, const SequenceCache& from, const SequenceCache& to) override {
    cache_.copy_sequence(from, to, model_.stream());
  }
  void copy_pages(int, const std::vector<PageCopy>& copies) override;
  StepOutput forward(const StepBatch& batch) override;
  void run_graph(const std::vector<ChunkRef>& chunks, const std::vector<int>& rows);
  int64_t bucket(const std::vector<ChunkRef>& chunks) const;
  // The captured batch size a decode step of n sequences runs as (n or a padded size), or 0:
  // eager.
  int graph_size(int n) const;

  struct Spec;
  // Speculation's MTP rows: the streams of `runs[which]` into the spec buffer at their
  // offsets, and the MTP states of `chunks` (row kept - 1), from `streams` whose rows are
  // numbered from row0[chunk] per chunk (the target forward's, or its rerun's).
  void move_mtp_rows(const StepBatch& b, const std::vector<int>& kept,
                     const std::vector<MtpRun>& runs, const std::vector<size_t>& which,
                     const std::vector<size_t>& chunks, const std::vector<int>& row0,
                     const __nv_bfloat16* streams);
  // The MTP block's run over `runs` and the drafts after the step.
  void mtp_after_step(const StepBatch& b, const std::vector<int>& kept,
                      const std::vector<MtpRun>& runs, StepOutput& out);
  // `v` copied into the spec buffer's device ints (pinned staging, one async copy).
  const int32_t* upload_ints(const std::vector<int32_t>& v);

  std::unique_ptr<Owned> owned_;  // destroyed last
  CudaModel& model_;
  DeviceCache cache_;
  StepBuffers meta_;
  CudaRunnerOptions opt_;
  CudaVerifier* verify_ = nullptr;
  std::map<std::pair<int, int64_t>, int> seen_;  // (batch, bucket) -> eager runs
  std::map<std::pair<int, int64_t>, Graph> graphs_;
  int64_t replays_ = 0;
  int64_t padded_ = 0;
  SequenceCache scratch_;         // the padding rows' sequence: the cache's extra sequence 0
  float* host_logits_ = nullptr;  // pinned [max_logit_rows, vocab]
  // The download in slices, each copied out of the pinned buffer while the next one (and the
  // sampler) runs; the copies go into a recycled vector when the caller handed one back.
  static constexpr int kLogitSlices = 8;
  cudaEvent_t slice_done_[kLogitSlices] = {};
  std::vector<float> spare_logits_;
  cuda::DeviceSampler sampler_;
  const __nv_bfloat16* main_hidden_ = nullptr;  // the last target forward's streams
  std::unique_ptr<Spec> spec_;
};

}  // namespace dsv4
