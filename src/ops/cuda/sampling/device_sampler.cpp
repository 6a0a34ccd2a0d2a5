#include "ops/cuda/sampling/device_sampler.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4::cuda {
namespace {

size_t align16(size_t v) {
  return (v + 15) & ~size_t(15);
}

// Byte offsets of the staging buffer's sections: row tasks, sample tasks, patch tokens, ops.
struct StagingLayout {
  size_t samples, tokens, ops, bytes;
  StagingLayout(size_t rows, size_t samples_, size_t tokens_, size_t ops_) {
    samples = align16(rows * sizeof(SamplingRowTask));
    tokens = align16(samples + samples_ * sizeof(SamplingSampleTask));
    ops = align16(tokens + tokens_ * sizeof(SamplingPatchToken));
    bytes = align16(ops + ops_ * sizeof(SamplingPatchOp));
  }
};

// Offsets of the results: row results, then sample results.
struct ResultsLayout {
  size_t samples, bytes;
  ResultsLayout(size_t rows, size_t samples_) {
    samples = align16(rows * sizeof(SamplingRowResult));
    bytes = align16(samples + samples_ * sizeof(SamplingSampleResult));
  }
};

}  // namespace

DeviceSampler::DeviceSampler(int vocab, int max_rows, int max_samples)
    : vocab_(vocab), max_rows_(max_rows), max_samples_(max_samples) {
  DSV4_CHECK(vocab > 0 && max_rows > 0 && max_samples > 0,
             "DeviceSampler: vocab, max_rows and max_samples must be positive");
  slot_.assign(size_t(vocab), -1);
  results_bytes_ = ResultsLayout(size_t(max_rows), size_t(max_samples)).bytes;
  DSV4_CUDA_CHECK(cudaMallocHost(&host_results_, results_bytes_));
  DSV4_CUDA_CHECK(cudaMalloc(&dev_results_, results_bytes_));
  DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
  // Room for a bias list and a short history per sample before the first growth.
  reserve_patches(size_t(max_samples) * 64, size_t(max_samples) * 128);
}

DeviceSampler::~DeviceSampler() {
  if (uploaded_) cudaEventDestroy(uploaded_);
  if (host_staging_) cudaFreeHost(host_staging_);
  if (dev_staging_) cudaFree(dev_staging_);
  if (dev_saved_raw_) cudaFree(dev_saved_raw_);
  if (host_results_) cudaFreeHost(host_results_);
  if (dev_results_) cudaFree(dev_results_);
}

void DeviceSampler::reserve_patches(size_t tokens, size_t ops) {
  DSV4_CHECK(tokens <= size_t(INT_MAX) && ops <= size_t(INT_MAX),
             "sampling: a step's penalty histories exceed 2^31 entries");
  const size_t bytes = StagingLayout(size_t(max_rows_), size_t(max_samples_), tokens, ops).bytes;
  if (bytes > staging_bytes_) {
    const size_t grown = std::max(bytes, staging_bytes_ * 2);
    if (host_staging_) DSV4_CUDA_CHECK(cudaFreeHost(host_staging_));
    if (dev_staging_) DSV4_CUDA_CHECK(cudaFree(dev_staging_));
    host_staging_ = dev_staging_ = nullptr;
    staging_bytes_ = 0;
    DSV4_CUDA_CHECK(cudaMallocHost(&host_staging_, grown));
    DSV4_CUDA_CHECK(cudaMalloc(&dev_staging_, grown));
    staging_bytes_ = grown;
  }
  if (tokens > saved_raw_capacity_) {
    const size_t grown = std::max(tokens, saved_raw_capacity_ * 2);
    if (dev_saved_raw_) DSV4_CUDA_CHECK(cudaFree(dev_saved_raw_));
    dev_saved_raw_ = nullptr;
    saved_raw_capacity_ = 0;
    DSV4_CUDA_CHECK(cudaMalloc(&dev_saved_raw_, grown * sizeof(float)));
    saved_raw_capacity_ = grown;
  }
}

// The tokens of sampled row `row` whose logit the bias or the penalties change, each with its
// operations in the reference's order (ops/cpu/sampler.cpp): its bias entries in list order,
// the repetition penalty when it is in the prompt or the output, then the frequency and
// presence subtraction of each of its output entries.
void DeviceSampler::add_patches(int row, const Sample& s) {
  const SamplingParams& p = *s.params;
  const bool penalised = s.counts && p.penalised();
  if (p.logit_bias.empty() && !penalised) return;
  const size_t first = patch_tokens_.size();
  adds_.clear();
  subs_.clear();
  repeats_.clear();
  auto slot = [&](int32_t t) {
    int32_t& j = slot_[size_t(t)];
    if (j < 0) {
      j = int32_t(patch_tokens_.size() - first);
      patch_tokens_.push_back({row, t, 0, 0});
      adds_.push_back(0);
      subs_.push_back(0);
      repeats_.push_back(0);
    }
    return size_t(j);
  };
  for (const auto& [t, b] : p.logit_bias) ++adds_[slot(t)];
  const bool repeat = penalised && p.repetition_penalty != 1;
  if (repeat) {
    for (int32_t t : s.counts->prompt) repeats_[slot(t)] = 1;
    for (const auto& [t, c] : s.counts->output) repeats_[slot(t)] = 1;
  }
  if (penalised)
    for (const auto& [t, c] : s.counts->output) ++subs_[slot(t)];
  const size_t n = patch_tokens_.size() - first;
  size_t o = patch_ops_.size();
  next_.resize(n);
  for (size_t j = 0; j < n; ++j) {
    SamplingPatchToken& pt = patch_tokens_[first + j];
    DSV4_CHECK(o + size_t(adds_[j] + repeats_[j] + subs_[j]) <= size_t(INT_MAX),
               "sampling: a step's penalty histories exceed 2^31 entries");
    pt.op_begin = int32_t(o);
    next_[j] = int32_t(o);
    o += size_t(adds_[j] + repeats_[j] + subs_[j]);
    pt.op_end = int32_t(o);
  }
  patch_ops_.resize(o);
  for (const auto& [t, b] : p.logit_bias)
    patch_ops_[size_t(next_[size_t(slot_[size_t(t)])]++)] = {kPatchAdd, b};
  if (repeat)
    for (size_t j = 0; j < n; ++j)
      if (repeats_[j]) patch_ops_[size_t(next_[j]++)] = {kPatchRepetition, p.repetition_penalty};
  if (penalised)
    for (const auto& [t, c] : s.counts->output)
      // The amount the reference subtracts, computed with its fp32 expression.
      patch_ops_[size_t(next_[size_t(slot_[size_t(t)])]++)] = {
          kPatchSubtract, p.frequency_penalty * float(c) + (c > 0 ? p.presence_penalty : 0.0f)};
  for (size_t j = 0; j < n; ++j) slot_[size_t(patch_tokens_[first + j].token)] = -1;
}

void DeviceSampler::stage(int rows, const std::vector<Sample>& samples,
                          const std::vector<Score>& scores) {
  staged_ = false;
  DSV4_CHECK(rows >= 0 && rows <= max_rows_, "sampling: ", rows, " rows, more than the planned ",
             max_rows_);
  DSV4_CHECK(samples.size() <= size_t(max_samples_), "sampling: ", samples.size(),
             " samples, more than the planned ", max_samples_);
  row_tasks_.assign(size_t(rows), SamplingRowTask{});
  std::vector<char> sampled(size_t(rows), 0), scored(size_t(rows), 0);
  for (const Sample& s : samples) {
    DSV4_CHECK(s.row >= 0 && s.row < rows, "sampled row ", s.row, " out of range [0, ", rows, ")");
    DSV4_CHECK(!sampled[size_t(s.row)], "row ", s.row, " sampled twice");
    sampled[size_t(s.row)] = 1;
    check_sampling_request(s.params, s.counts, s.forced, vocab_);
  }
  for (const Score& s : scores) {
    DSV4_CHECK(s.row >= 0 && s.row < rows, "scored row ", s.row, " out of range [0, ", rows, ")");
    DSV4_CHECK(!scored[size_t(s.row)], "row ", s.row, " scored twice");
    scored[size_t(s.row)] = 1;
    DSV4_CHECK(s.id >= 0 && s.id < vocab_, "scored token ", s.id, " out of range [0, ", vocab_,
               ")");
    DSV4_CHECK(s.top >= 0 && s.top <= kMaxTopLogprobs, "score top must be in [0, ", kMaxTopLogprobs,
               "]");
  }
  // Inputs are valid: build the tasks.
  sample_tasks_.clear();
  patch_tokens_.clear();
  patch_ops_.clear();
  sample_top_.clear();
  sample_logprob_.clear();
  for (const Sample& s : samples) {
    const SamplingParams& p = *s.params;
    const bool want = p.logprobs || p.top_logprobs > 0;
    SamplingRowTask& rt = row_tasks_[size_t(s.row)];
    if (want) {
      rt.need_lse = 1;
      rt.top_n = std::max(rt.top_n, p.top_logprobs);
    }
    SamplingSampleTask t;
    t.row = s.row;
    t.top_k = p.top_k;
    t.temperature = p.temperature;
    t.top_p = p.top_p;
    t.min_p = p.min_p;
    t.forced = s.forced >= 0 ? s.forced : -1;
    t.want_logprob = want ? 1 : 0;
    t.seed = p.seed;
    t.index = s.index;
    t.patch_begin = int32_t(patch_tokens_.size());
    add_patches(s.row, s);
    t.patch_end = int32_t(patch_tokens_.size());
    sample_tasks_.push_back(t);
    sample_top_.push_back(p.top_logprobs);
    sample_logprob_.push_back(want ? 1 : 0);
  }
  for (const Score& s : scores) {
    SamplingRowTask& rt = row_tasks_[size_t(s.row)];
    rt.need_lse = 1;
    rt.score_id = s.id;
    rt.top_n = std::max(rt.top_n, s.top);
  }
  scores_ = scores;
  reserve_patches(patch_tokens_.size(), patch_ops_.size());
  // The previous upload must be done before the staging buffer is rewritten.
  DSV4_CUDA_CHECK(cudaEventSynchronize(uploaded_));
  const StagingLayout l(size_t(rows), sample_tasks_.size(), patch_tokens_.size(),
                        patch_ops_.size());
  std::memcpy(host_staging_, row_tasks_.data(), row_tasks_.size() * sizeof(SamplingRowTask));
  std::memcpy(host_staging_ + l.samples, sample_tasks_.data(),
              sample_tasks_.size() * sizeof(SamplingSampleTask));
  std::memcpy(host_staging_ + l.tokens, patch_tokens_.data(),
              patch_tokens_.size() * sizeof(SamplingPatchToken));
  std::memcpy(host_staging_ + l.ops, patch_ops_.data(),
              patch_ops_.size() * sizeof(SamplingPatchOp));
  rows_ = rows;
  staged_ = true;
  launched_ = false;
}

void DeviceSampler::launch(float* logits, cudaStream_t stream) {
  DSV4_CHECK(staged_, "DeviceSampler::launch without a staged step");
  staged_ = false;
  if (rows_ == 0) {
    launched_ = true;
    return;
  }
  const StagingLayout l(size_t(rows_), sample_tasks_.size(), patch_tokens_.size(),
                        patch_ops_.size());
  const ResultsLayout r(size_t(rows_), sample_tasks_.size());
  DSV4_CUDA_CHECK(
      cudaMemcpyAsync(dev_staging_, host_staging_, l.bytes, cudaMemcpyHostToDevice, stream));
  DSV4_CUDA_CHECK(cudaEventRecord(uploaded_, stream));
  SamplingLaunch p;
  p.logits = logits;
  p.rows = rows_;
  p.vocab = vocab_;
  p.row_tasks = reinterpret_cast<const SamplingRowTask*>(dev_staging_);
  p.samples = reinterpret_cast<const SamplingSampleTask*>(dev_staging_ + l.samples);
  p.num_samples = int(sample_tasks_.size());
  p.patch_tokens = reinterpret_cast<const SamplingPatchToken*>(dev_staging_ + l.tokens);
  p.num_patch_tokens = int(patch_tokens_.size());
  p.patch_ops = reinterpret_cast<const SamplingPatchOp*>(dev_staging_ + l.ops);
  p.num_patch_ops = int(patch_ops_.size());
  p.saved_raw = dev_saved_raw_;
  p.row_results = reinterpret_cast<SamplingRowResult*>(dev_results_);
  p.sample_results = reinterpret_cast<SamplingSampleResult*>(dev_results_ + r.samples);
  sample_rows(p, stream);
  DSV4_CUDA_CHECK(
      cudaMemcpyAsync(host_results_, dev_results_, r.bytes, cudaMemcpyDeviceToHost, stream));
  launched_ = true;
}

const SamplingRowResult& DeviceSampler::row_result(int row) const {
  DSV4_CHECK(launched_ && row >= 0 && row < rows_, "DeviceSampler: no result for row ", row);
  return reinterpret_cast<const SamplingRowResult*>(host_results_)[row];
}

int32_t DeviceSampler::nonfinite_index(int row) const {
  return row_result(row).nonfinite_index;
}

float DeviceSampler::nonfinite_value(int row) const {
  return row_result(row).nonfinite_value;
}

SampledToken DeviceSampler::sample(int i) const {
  DSV4_CHECK(launched_ && i >= 0 && size_t(i) < sample_tasks_.size(), "DeviceSampler: no sample ",
             i);
  const SamplingSampleResult& sr = reinterpret_cast<const SamplingSampleResult*>(
      host_results_ + ResultsLayout(size_t(rows_), sample_tasks_.size()).samples)[i];
  SampledToken out;
  if (sr.id < 0) return out;
  DSV4_CHECK(sr.id < vocab_, "DeviceSampler: sampled id ", sr.id, " out of range");
  out.id = sr.id;
  if (sample_logprob_[size_t(i)]) {
    out.logprob = sr.logprob;
    const SamplingRowResult& rr = row_result(sample_tasks_[size_t(i)].row);
    const int k = std::min(sample_top_[size_t(i)], rr.top_count);
    for (int a = 0; a < k; ++a) out.top.emplace_back(rr.top_ids[a], rr.top_logprobs[a]);
  }
  return out;
}

SampledToken DeviceSampler::score(int i) const {
  DSV4_CHECK(launched_ && i >= 0 && size_t(i) < scores_.size(), "DeviceSampler: no score ", i);
  const Score& s = scores_[size_t(i)];
  const SamplingRowResult& rr = row_result(s.row);
  SampledToken out;
  if (rr.nonfinite_index >= 0) return out;
  out.id = s.id;
  out.logprob = rr.score_logprob;
  const int k = std::min(s.top, rr.top_count);
  for (int a = 0; a < k; ++a) out.top.emplace_back(rr.top_ids[a], rr.top_logprobs[a]);
  return out;
}

void DeviceSampler::fill_results(int byte) {
  DSV4_CUDA_CHECK(cudaMemset(dev_results_, byte, results_bytes_));
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace dsv4::cuda
