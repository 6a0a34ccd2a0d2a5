#include "backends/cpu/host_sampling.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/parallel.h"
#include "model/weights.h"
#include "ops/cpu/sampler.h"

namespace dsv4 {
namespace {

// Whether a row holds NaN or +-inf: an exponent of all ones, tested on the bits so that the
// loop vectorises (a row is 129,280 floats at the real vocabulary).
bool has_non_finite(const float* row, int n) {
  uint32_t any = 0;
  for (int v = 0; v < n; ++v) {
    uint32_t b;
    std::memcpy(&b, row + v, 4);
    any |= uint32_t((b & 0x7f800000u) == 0x7f800000u);
  }
  return any != 0;
}

}  // namespace

std::vector<SampledToken> verify_samples(const float* logits, int V, const std::vector<int>& rows,
                                         const int32_t* drafts, const SampleSpec& s,
                                         const SampledToken& first) {
  std::vector<SampledToken> more;
  TokenCounts counts;
  if (s.counts) counts = *s.counts;
  SampledToken last = first;
  for (size_t j = 1; j < rows.size(); ++j) {
    if (last.id != drafts[j - 1]) break;  // rejected: `last` replaces the draft
    if (s.counts) {
      auto it = std::find_if(counts.output.begin(), counts.output.end(),
                             [&](const auto& e) { return e.first == last.id; });
      if (it == counts.output.end())
        counts.output.emplace_back(last.id, 1);
      else
        ++it->second;
    }
    const int64_t index = s.index + int64_t(j);
    const int32_t forced = s.forced_from && index < int64_t(s.forced_from->size())
                               ? (*s.forced_from)[size_t(index)]
                               : -1;
    last = cpu::sample_row(logits + size_t(rows[j]) * V, V, *s.params, index,
                           s.counts ? &counts : nullptr, forced);
    more.push_back(last);
  }
  return more;
}

std::string nonfinite_logits_error(int64_t position, int vocab_id, float value) {
  return cat("non-finite logits at position ", position, " (vocabulary id ", vocab_id, ": ", value,
             ")");
}

StepOutput sample_on_host(const StepBatch& b, const float* logits, int V,
                          std::vector<std::string> errors) {
  StepOutput out;
  out.errors = std::move(errors);
  out.errors.resize(b.chunks.size());
  // First token row of each input.
  std::vector<int> row0(b.chunks.size(), 0);
  for (size_t i = 1; i < b.chunks.size(); ++i) row0[i] = row0[i - 1] + b.chunks[i - 1].n;
  // Rows with non-finite logits, found in parallel; the first of each input is named.
  std::vector<char> bad(b.rows.size(), 0);
  // (Over the host's cores at a large batch: a decode step of 128 rows scans 128 x 129,280 logits.)
  parallel_for(int64_t(b.rows.size()), int64_t(b.rows.size()) * V,
               [&](int64_t i) { bad[i] = has_non_finite(logits + i * size_t(V), V) ? 1 : 0; });
  for (size_t i = 0; i < b.rows.size(); ++i) {
    const int in = b.row_input[i];
    std::string& e = out.errors[size_t(in)];
    if (!e.empty() || !bad[i]) continue;
    const float* row = logits + i * size_t(V);
    for (int v = 0; v < V; ++v)
      if (!std::isfinite(row[v])) {
        e = nonfinite_logits_error(b.chunks[size_t(in)].start + (b.rows[i] - row0[size_t(in)]), v,
                                   row[v]);
        break;
      }
  }
  auto failed = [&](int row_index) {
    return !out.errors[size_t(b.row_input[size_t(row_index)])].empty();
  };
  out.samples.resize(b.samples.size());
  out.more.resize(b.samples.size());
  out.drafts.resize(b.samples.size());
  parallel_for(int64_t(b.samples.size()), int64_t(b.samples.size()) * V, [&](int64_t i) {
    const SampleSpec& s = *b.samples[i];
    if (failed(b.sample_rows[i])) return;  // id -1
    out.samples[i] = cpu::sample_row(logits + size_t(b.sample_rows[i]) * V, V, *s.params, s.index,
                                     s.counts, s.forced);
    const std::vector<int>& vr = b.verify_rows.empty() ? std::vector<int>() : b.verify_rows[i];
    if (vr.empty()) return;
    // A verify: row j is sampled as plain decoding samples output index + j, and the next row
    // counts only while the sample equals the draft after it (see verify_samples()).
    const ChunkRef& ch = b.chunks[size_t(b.sample_inputs[i])];
    const int32_t* drafts = ch.tokens + ch.n - int(vr.size());
    std::vector<int> rows{b.sample_rows[i]};
    rows.insert(rows.end(), vr.begin(), vr.end());
    out.more[i] = verify_samples(logits, V, rows, drafts, s, out.samples[i]);
  });
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
