#include "backends/cpu/runner.h"

#include "backends/cpu/host_sampling.h"

namespace dsv4 {

CpuRunner::CpuRunner(const CpuModel& model, const CacheConfig& cache)
    : PagedRunner(model.config(), cache, Limits{}), model_(model), cache_(model.config(), cache) {}

void CpuRunner::copy_pages(int, const std::vector<PageCopy>& copies) {
  for (const PageCopy& c : copies) cache_.copy_page(c);
}

StepOutput CpuRunner::forward(const StepBatch& b) {
  const int V = config().vocab_size;
  std::vector<int> bad;  // per token row: the first block with non-finite output, or -1
  std::vector<float> logits = model_.forward(b.chunks, cache_, b.rows, trace_, hidden_out_, &bad);
  StepOutput out = sample_on_host(b, logits.data(), V, nonfinite_errors(config(), b, bad));
  logits.resize(size_t(b.num_logit_rows) * V);
  out.logits = std::move(logits);
  return out;
}

StepOutput CpuRunner::step_traced(const std::vector<StepInput>& inputs, TraceSink* trace,
                                  std::vector<float>* hidden_out) {
  trace_ = trace;
  hidden_out_ = hidden_out;
  struct Reset {
    CpuRunner* r;
    ~Reset() { r->trace_ = nullptr, r->hidden_out_ = nullptr; }
  } reset{this};
  return step(inputs);
}

}  // namespace dsv4
