#include "runtime/cpu_runner.h"

#include <set>

#include "core/error.h"

namespace dsv4 {

CpuRunner::CpuRunner(const CpuModel& model, const CacheConfig& cache)
    : model_(model), blocks_(model.config(), cache), cache_(model.config(), cache) {}

int CpuRunner::open_sequence() {
  SequenceCache s = blocks_.begin_sequence();
  cache_.reset_states(s.state_slot);
  const int id = next_id_++;
  seqs_.emplace(id, std::move(s));
  return id;
}

void CpuRunner::close_sequence(int seq) {
  auto it = seqs_.find(seq);
  DSV4_CHECK(it != seqs_.end(), "unknown sequence ", seq);
  blocks_.end_sequence(it->second);
  seqs_.erase(it);
}

SequenceCache& CpuRunner::sequence(int seq) {
  auto it = seqs_.find(seq);
  DSV4_CHECK(it != seqs_.end(), "unknown sequence ", seq);
  return it->second;
}

int64_t CpuRunner::length(int seq) const {
  auto it = seqs_.find(seq);
  DSV4_CHECK(it != seqs_.end(), "unknown sequence ", seq);
  return it->second.tokens;
}

std::vector<float> CpuRunner::step(const std::vector<StepInput>& inputs, TraceSink* trace,
                                   std::vector<float>* hidden_out) {
  const ModelConfig& c = model_.config();
  std::set<int> seen;
  for (const auto& in : inputs) {
    DSV4_CHECK(seen.insert(in.seq).second, "sequence ", in.seq, " appears twice in one step");
    SequenceCache& s = sequence(in.seq);
    DSV4_CHECK(!in.tokens.empty(), "empty token list for sequence ", in.seq);
    for (int32_t t : in.tokens)
      DSV4_CHECK(t >= 0 && t < c.vocab_size, "token id ", t, " out of range [0, ", c.vocab_size,
                 ")");
    DSV4_CHECK(s.tokens + int64_t(in.tokens.size()) <= c.max_position_embeddings,
               "sequence would exceed max_position_embeddings (", c.max_position_embeddings, ")");
  }
  // Reserve every sequence's pages before touching any state: a step that cannot get its
  // pages fails without running (pages already reserved stay with their sequences).
  for (const auto& in : inputs) {
    SequenceCache& s = sequence(in.seq);
    blocks_.reserve(s, s.tokens + int64_t(in.tokens.size()));
  }
  std::vector<ChunkRef> chunks;
  std::vector<int> rows;
  int row = 0;
  for (const auto& in : inputs) {
    SequenceCache& s = sequence(in.seq);
    chunks.push_back({&s, s.tokens, in.tokens.data(), static_cast<int>(in.tokens.size())});
    const int n = static_cast<int>(in.tokens.size());
    if (in.all_logits)
      for (int i = 0; i < n; ++i) rows.push_back(row + i);
    else
      rows.push_back(row + n - 1);
    row += n;
  }
  std::vector<float> logits = model_.forward(chunks, cache_, rows, trace, hidden_out);
  for (const auto& in : inputs) sequence(in.seq).tokens += int64_t(in.tokens.size());
  return logits;
}

}  // namespace dsv4
