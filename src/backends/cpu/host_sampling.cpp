#include "backends/cpu/host_sampling.h"

#include "ops/cpu/sampler.h"

namespace dsv4 {

StepOutput sample_on_host(const StepBatch& b, const float* logits, int V) {
  StepOutput out;
  for (size_t i = 0; i < b.samples.size(); ++i) {
    const SampleSpec& s = *b.samples[i];
    out.samples.push_back(cpu::sample_row(logits + size_t(b.sample_rows[i]) * V, V, *s.params,
                                          s.index, s.counts, s.forced));
  }
  for (const StepBatch::Score& sc : b.scores) {
    std::vector<SampledToken> row(sc.rows.size());
    for (size_t j = 0; j < sc.rows.size(); ++j)
      if (sc.rows[j] >= 0)
        row[j] = cpu::score_row(logits + size_t(sc.rows[j]) * V, V, (*sc.ids)[j], sc.top);
    out.scores.push_back(std::move(row));
  }
  return out;
}

}  // namespace dsv4
