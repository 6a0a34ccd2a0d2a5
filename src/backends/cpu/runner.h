// The CPU backend's runner: the CPU model over a host cache (HostCache) in the shared byte
// layout, sampling with the reference sampler. One step takes any mix of prefill chunks and
// decode tokens, one contiguous run of tokens per sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backends/cpu/host_cache.h"
#include "backends/cpu/loader.h"
#include "backends/cpu/model.h"
#include "model/paged_runner.h"

namespace dsv4 {

class CpuRunner final : public PagedRunner {
 public:
  CpuRunner(const CpuModel& model, const CacheConfig& cache);

  // step() with observers: `trace` receives the model's named tensors, `hidden_out` the last
  // layer's streams [total rows, hc, dim] (the MTP block's input).
  StepOutput step_traced(const std::vector<StepInput>& inputs, TraceSink* trace,
                         std::vector<float>* hidden_out = nullptr);

  // Speculative decoding (Runner): the MTP block drafts (see runner.cpp for how it is fed),
  // verifies roll back by restoring what the step overwrote and re-running the accepted
  // tokens, so every store is bit for bit what plain decoding leaves.
  void enable_speculation(Rollback rollback = Rollback::kRerun) override;
  bool speculation_enabled() const override { return spec_; }

  HostCache& cache() { return cache_; }
  const CpuModel& model() const { return model_; }
  // Keeps the model this runner runs alive (a runner opened from a model directory).
  void adopt(std::unique_ptr<LoadedModel> model) { owned_ = std::move(model); }

 private:
  void reset_states(int, int slot) override { cache_.reset_states(slot); }
  void copy_sequence(int, const SequenceCache& from, const SequenceCache& to) override {
    cache_.copy_sequence(from, to);
  }
  void copy_pages(int, const std::vector<PageCopy>& copies) override;
  StepOutput forward(const StepBatch& batch) override;
  // After a step that kept kept[i] tokens of input i: the MTP block over the positions whose
  // next token became known, then the drafts asked for.
  void mtp_after_step(const StepBatch& b, const std::vector<int>& kept, const float* hidden,
                      StepOutput& out);

  std::unique_ptr<LoadedModel> owned_;  // destroyed last
  const CpuModel& model_;
  HostCache cache_;
  TraceSink* trace_ = nullptr;
  std::vector<float>* hidden_out_ = nullptr;
  bool spec_ = false;
  Rollback rollback_ = Rollback::kRerun;
};

}  // namespace dsv4
