#include "backends/cpu/host_sampling.h"

#include <cmath>

#include "core/error.h"
#include "model/weights.h"
#include "ops/cpu/sampler.h"

namespace dsv4 {

StepOutput sample_on_host(const StepBatch& b, const float* logits, int V,
                          std::vector<std::string> errors) {
  StepOutput out;
  out.errors = std::move(errors);
  out.errors.resize(b.chunks.size());
  // First token row of each input.
  std::vector<int> row0(b.chunks.size(), 0);
  for (size_t i = 1; i < b.chunks.size(); ++i) row0[i] = row0[i - 1] + b.chunks[i - 1].n;
  for (size_t i = 0; i < b.rows.size(); ++i) {
    const int in = b.row_input[i];
    std::string& e = out.errors[size_t(in)];
    if (!e.empty()) continue;
    const float* row = logits + i * size_t(V);
    for (int v = 0; v < V; ++v)
      if (!std::isfinite(row[v])) {
        e = cat("non-finite logits at position ",
                b.chunks[size_t(in)].start + (b.rows[i] - row0[size_t(in)]), " (vocabulary id ", v,
                ": ", row[v], ")");
        break;
      }
  }
  auto failed = [&](int row_index) {
    return !out.errors[size_t(b.row_input[size_t(row_index)])].empty();
  };
  for (size_t i = 0; i < b.samples.size(); ++i) {
    const SampleSpec& s = *b.samples[i];
    if (failed(b.sample_rows[i])) {
      out.samples.emplace_back();
      continue;
    }
    out.samples.push_back(cpu::sample_row(logits + size_t(b.sample_rows[i]) * V, V, *s.params,
                                          s.index, s.counts, s.forced));
  }
  for (const StepBatch::Score& sc : b.scores) {
    std::vector<SampledToken> row(sc.rows.size());
    for (size_t j = 0; j < sc.rows.size(); ++j)
      if (sc.rows[j] >= 0 && !failed(sc.rows[j]))
        row[j] = cpu::score_row(logits + size_t(sc.rows[j]) * V, V, (*sc.ids)[j], sc.top);
    out.scores.push_back(std::move(row));
  }
  return out;
}

std::vector<std::string> nonfinite_errors(const ModelConfig& c, const StepBatch& b,
                                          const std::vector<int>& bad) {
  std::vector<std::string> errors(b.chunks.size());
  int row = 0;
  for (size_t i = 0; i < b.chunks.size(); ++i) {
    for (int j = 0; j < b.chunks[i].n && errors[i].empty(); ++j) {
      const int block = bad[size_t(row + j)];
      if (block < 0) continue;
      std::string name = block_prefix(c, block);
      if (!name.empty() && name.back() == '.') name.pop_back();
      errors[i] = cat("non-finite hidden state at position ", b.chunks[i].start + j,
                      ", first in block ", block, " (", name, ")");
    }
    row += b.chunks[i].n;
  }
  return errors;
}

}  // namespace dsv4
