// The host side of GPU sampling: validates a step's sample and score requests, packs their
// parameters (and the penalty histories, as patches of the tokens they touch) into one pinned
// staging buffer uploaded with one copy, enqueues the kernels (sampling.h), and downloads the
// results (ids, logprobs, top alternatives, non-finite flags) with one copy into pinned
// memory. Buffers are allocated for the largest step up front; the patch arrays grow (doubling)
// when a step's histories need more.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "ops/common/sampling.h"
#include "ops/cuda/sampling/sampling.h"

namespace dsv4::cuda {

class DeviceSampler {
 public:
  // Choose a token from row `row` (see SampleSpec, model/runner.h).
  struct Sample {
    int row = -1;
    const SamplingParams* params = nullptr;
    int64_t index = 0;
    const TokenCounts* counts = nullptr;
    int32_t forced = -1;
  };
  // The logprob of `id` in row `row` and its `top` most likely alternatives.
  struct Score {
    int row = -1;
    int32_t id = -1;
    int top = 0;
  };

  DeviceSampler(int vocab, int max_rows, int max_samples);
  ~DeviceSampler();
  DeviceSampler(const DeviceSampler&) = delete;
  DeviceSampler& operator=(const DeviceSampler&) = delete;

  // Validates every input (throws dsv4::Error, leaving nothing staged) and packs the step.
  // At most one sample and one score per row.
  void stage(int rows, const std::vector<Sample>& samples, const std::vector<Score>& scores);
  // Enqueues on `stream` the upload, the kernels over `logits` [rows, vocab] (device), and the
  // download of the results. Sampled rows with logit_bias or penalties are modified in place
  // (download whatever raw logits are needed before). The results are readable once the
  // stream has been synchronised.
  void launch(float* logits, cudaStream_t stream);

  // Results of the last launch, after synchronising its stream.
  int32_t nonfinite_index(int row) const;  // the row's first non-finite logit, -1: none
  float nonfinite_value(int row) const;
  SampledToken sample(int i) const;  // id -1 when its row is not finite
  SampledToken score(int i) const;

  // Fills the device results with `byte` (tests poison outputs this way), synchronously.
  void fill_results(int byte);

  int vocab() const { return vocab_; }
  int max_rows() const { return max_rows_; }
  int max_samples() const { return max_samples_; }

 private:
  void reserve_patches(size_t tokens, size_t ops);
  void add_patches(int row, const Sample& s);
  const SamplingRowResult& row_result(int row) const;

  int vocab_, max_rows_, max_samples_;
  // The step being staged.
  int rows_ = 0;
  bool staged_ = false, launched_ = false;
  std::vector<SamplingRowTask> row_tasks_;
  std::vector<SamplingSampleTask> sample_tasks_;
  std::vector<SamplingPatchToken> patch_tokens_;
  std::vector<SamplingPatchOp> patch_ops_;
  std::vector<Score> scores_;
  std::vector<int> sample_top_;       // per sample: top_logprobs
  std::vector<char> sample_logprob_;  // per sample: logprobs wanted
  std::vector<int32_t> slot_;         // [vocab] token -> patch index while building one row (-1)
  std::vector<int> adds_, subs_, repeats_, next_;  // per patch token of the row being built
  // Pinned staging and its device copy; results on the device and their pinned copy.
  size_t staging_bytes_ = 0;
  char* host_staging_ = nullptr;
  char* dev_staging_ = nullptr;
  float* dev_saved_raw_ = nullptr;
  size_t saved_raw_capacity_ = 0;
  size_t results_bytes_ = 0;
  char* host_results_ = nullptr;
  char* dev_results_ = nullptr;
  cudaEvent_t uploaded_ = nullptr;  // the last upload of the staging buffer
};

}  // namespace dsv4::cuda
