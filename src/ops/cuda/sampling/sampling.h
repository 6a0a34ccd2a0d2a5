// Sampling and scoring on the GPU, on fp32 logits rows in device memory, with exactly the rules
// of ops/common/sampling.h (the reference is cpu::sample_row / cpu::score_row, ops/cpu/
// sampler.h). Three kernels, one stream:
//  1. per computed row: the first non-finite logit (index and value); when asked, the raw
//     row's log-sum-exp (fp64, as score_row), the logprob of one scored id and the `top_n`
//     most likely ids (larger first, ties to the lower index);
//  2. per patched token of a sampled row (logit_bias, penalties): the raw value saved, the
//     modified one written IN PLACE into the row, with the reference's fp32 operations in its
//     order (bias entries in list order, then repetition, then frequency/presence);
//  3. per sampled row: the forced id, the greedy argmax, or temperature/min_p/top_k/top_p and
//     the exponential race with sample_uniform(); the chosen id's logprob from the raw value.
//
// The chosen id equals cpu::sample_row's on the same logits. The only operations whose results
// can differ from the CPU's are fp64 exp() and log() (CUDA's and glibc's are both within one
// ulp, not necessarily the same ulp) and the order of fp64 sums (the top-p mass and its
// cumulative sums; here exact fixed-point sums, on the CPU sequential ones, each within
// n * 2^-53 relative). A choice flips only when a comparison falls within that margin (a
// probability of order 1e-11 per draw at the real vocabulary), see sampling.cu.
//
// The plain parameter struct below is what the kernels read; DeviceSampler
// (device_sampler.h) builds it from SamplingParams and validates every input.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/sampling.h"

namespace dsv4::cuda {

// What kernel 1 computes for one row.
struct SamplingRowTask {
  int32_t top_n = 0;      // most likely raw ids to report, <= kMaxTopLogprobs
  int32_t score_id = -1;  // >= 0: report this id's logprob
  int32_t need_lse = 0;   // the log-sum-exp is needed (top_n, score_id or a sampled logprob)
  int32_t pad = 0;
};

// One sampled row.
struct SamplingSampleTask {
  int32_t row = 0;
  int32_t top_k = 0;
  float temperature = 0;
  float top_p = 1;
  float min_p = 0;
  int32_t forced = -1;
  int32_t want_logprob = 0;
  int32_t patch_begin = 0, patch_end = 0;  // its range of patch tokens
  int32_t pad = 0;
  uint64_t seed = 0;
  int64_t index = 0;
};

// One token of a sampled row whose logit is modified, with its operations.
struct SamplingPatchToken {
  int32_t row = 0;
  int32_t token = 0;
  int32_t op_begin = 0, op_end = 0;
};

enum SamplingPatchKind : int32_t { kPatchAdd = 0, kPatchRepetition = 1, kPatchSubtract = 2 };
struct SamplingPatchOp {
  int32_t kind = kPatchAdd;
  float value = 0;  // the bias, the repetition penalty, or the amount subtracted
};

// What kernel 1 writes per row.
struct SamplingRowResult {
  int32_t nonfinite_index = -1;  // the first non-finite logit, -1: none
  float nonfinite_value = 0;
  float score_logprob = 0;
  int32_t top_count = 0;
  int32_t top_ids[kMaxTopLogprobs];
  float top_logprobs[kMaxTopLogprobs];
  double lse = 0;  // the raw row's log-sum-exp
};

// What kernel 3 writes per sampled row (id -1 when its row is not finite).
struct SamplingSampleResult {
  int32_t id = -1;
  float logprob = 0;
};

struct SamplingLaunch {
  float* logits = nullptr;  // [rows, vocab] fp32, device; patched rows modified in place
  int rows = 0;
  int vocab = 0;
  const SamplingRowTask* row_tasks = nullptr;   // [rows]
  const SamplingSampleTask* samples = nullptr;  // [num_samples], distinct rows
  int num_samples = 0;
  const SamplingPatchToken* patch_tokens = nullptr;  // [num_patch_tokens], distinct per row
  int num_patch_tokens = 0;
  const SamplingPatchOp* patch_ops = nullptr;  // [num_patch_ops]
  int num_patch_ops = 0;
  float* saved_raw = nullptr;                      // [num_patch_tokens] scratch
  SamplingRowResult* row_results = nullptr;        // [rows]
  SamplingSampleResult* sample_results = nullptr;  // [num_samples]
};

// Enqueues the three kernels on `stream`. Checks the sizes and pointers (not the device
// arrays' contents: DeviceSampler validates those before they are uploaded).
void sample_rows(const SamplingLaunch& p, cudaStream_t stream);

}  // namespace dsv4::cuda
