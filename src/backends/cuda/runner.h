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
// of a shape runs eagerly (it also sets the kernels' function attributes), the second
// captures, later ones replay. Graph replay and eager runs give the same bits.
//
// Speculative decoding (enable_speculation(); model/speculation.h for the shared rules): a
// verify's k + 1 tokens run as one chunk through the real kernels, every row sampled at once
// on the device (row j with the drafts before it in its penalty history, model/speculation.h),
// acceptance decided on the host from the ids. Before the step, the stores a verify overwrites
// are saved device to device (CacheRollback); a sequence with rejected drafts gets them back
// and its kept tokens run again as one chunk, whose streams then feed the MTP block
// (Rollback::kRerun), or gets back only what its rejected positions changed, the verify's
// streams feeding the MTP block (Rollback::kRestore: no second forward). Drafts:
// the MTP block on the device, chained, its greedy choice drawn by the device sampler; its ring
// slots restored after drafting.
//
// Graphs with speculation: every step whose chunks hold at most kMaxDraftTokens + 1 tokens (a
// verify, the rerun of kept tokens, the MTP block's run over them, each chained draft step) is
// captured like a decode step, keyed by (pass, tokens per sequence, logits rows, bucket) and
// padded with one-token scratch rows to the captured batch sizes; the MTP passes read their
// own metadata buffers and input rows, so a replay sees the step's. A verify's graph begins
// with the rollback's saves (the segment list's copy from pinned memory and the copy kernel,
// padded to a count fixed by the shape); restores happen only after a rejection, outside. At most
// kMaxShapedGraphs graphs of steps that are not plain decode steps are kept (mixed k and
// acceptance make many shapes); a shape past that runs eagerly and is counted
// (eager_shaped_steps()).
//
// The two rollbacks: kRerun (the default) leaves, at zero acceptance, exactly the stores of a
// plain decode step, byte for byte (speculative_cuda_test), because the rerun is one (a graph
// replay of a decode shape); stores kept from a (k + 1)-row verify agree with a plain run's
// only within the end-to-end tolerance (the kernels are not shape-invariant). kRestore puts
// back only the rejected positions' stores and state rows (for_each_rejected_store, whose
// reconstruction of the overlapping ratio-4 states the CPU tests prove bit for bit against
// plain decoding) and saves the rerun's forward at every rejection.
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
#include <tuple>
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
  // Eager decode steps (and, with speculation, eager steps of graph shape: verify, rerun and
  // MTP steps of at most kMaxDraftTokens + 1 tokens per sequence) size their launches with the
  // same bucketed position bound as graphs (so an eager run and a graph replay compute the same
  // bits; tests compare them).
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

  void enable_speculation(Rollback rollback = Rollback::kRerun) override;
  bool speculation_enabled() const override { return spec_ != nullptr; }

  DeviceCache& cache() { return cache_; }
  CudaModel& model() { return model_; }
  int graphs_captured() const { return int(graphs_.size()); }
  int64_t graph_replays() const { return replays_; }
  // Replays of graphs whose steps are not one token per sequence (verify, rerun, MTP run).
  int64_t shaped_graph_replays() const { return shaped_replays_; }
  int64_t padded_steps() const { return padded_; }
  // Steps of graph shape run eagerly because kMaxShapedGraphs shapes were already captured.
  int64_t eager_shaped_steps() const { return eager_shaped_; }
  static constexpr int kMaxShapedGraphs = 64;

 private:
  // The forward passes a step shape is captured for, each with its own metadata buffer and
  // input rows: the target model, the MTP block's run over a step's positions, its drafts.
  enum class Pass { kTarget, kMtpRun, kMtpDraft };
  struct GraphKey {
    Pass pass = Pass::kTarget;
    std::vector<int> tokens;  // per sequence, padded rows included
    int rows = 0;             // logits rows
    int64_t end = 0;          // the context bucket's end
    size_t saves = 0;         // the rollback's save segments the graph copies first (padded)
    bool operator<(const GraphKey& o) const {
      return std::tie(pass, tokens, rows, end, saves) <
             std::tie(o.pass, o.tokens, o.rows, o.end, o.saves);
    }
  };
  struct Graph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    const __nv_bfloat16* hidden = nullptr;  // where a replay leaves its output streams
  };
  void reset_states(int, int slot) override { cache_.reset_states(slot, model_.stream()); }
  void copy_sequence(int, const SequenceCache& from, const SequenceCache& to) override {
    cache_.copy_sequence(from, to, model_.stream());
  }
  void copy_pages(int, const std::vector<PageCopy>& copies) override;
  StepOutput forward(const StepBatch& batch) override;
  // One pass of `chunks` (logits of `rows`; MTP: input streams `mtp_in`) with metadata in
  // `meta`: a graph replay (captured on the shape's second run) when graphs are on, no observer
  // watches and the shape is graph-sized (`shaped`: chunks of at most kMaxDraftTokens + 1 tokens;
  // else decode steps only), padded with scratch rows to a captured batch size; else eager.
  // Returns the pass's output streams (the target's last-layer streams, the MTP block's).
  // `saves` > 0: the rollback's queued saves, padded to that many segments (pad_saves), are
  // copied first, inside the graph (a per-step part of the verify).
  const __nv_bfloat16* run_pass(Pass pass, StepBuffers& meta, const std::vector<ChunkRef>& chunks,
                                const std::vector<int>& rows, bool shaped,
                                const __nv_bfloat16* mtp_in = nullptr, size_t saves = 0);
  // The pass itself (kMtpRun: the MTP block without its head).
  void pass_forward(Pass pass, const DeviceStep& st, const __nv_bfloat16* mtp_in);
  const __nv_bfloat16* run_graph(Pass pass, StepBuffers& meta, const std::vector<ChunkRef>& chunks,
                                 const std::vector<int>& rows, const __nv_bfloat16* mtp_in,
                                 size_t saves);
  int64_t bucket(const std::vector<ChunkRef>& chunks) const;
  // The captured batch size a step of `chunks` (logits of `rows` rows) runs as (its size or a
  // padded size), or 0: eager.
  int graph_size(const std::vector<ChunkRef>& chunks, int rows) const;

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
  std::map<GraphKey, int> seen_;  // shape -> eager runs
  std::map<GraphKey, Graph> graphs_;
  int shaped_graphs_ = 0;  // graphs of steps other than plain decode steps
  int64_t replays_ = 0;
  int64_t shaped_replays_ = 0;
  int64_t padded_ = 0;
  int64_t eager_shaped_ = 0;
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
  Rollback rollback_ = Rollback::kRerun;
};

}  // namespace dsv4
