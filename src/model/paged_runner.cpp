#include "model/paged_runner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "core/error.h"
#include "model/cache_spec.h"

namespace dsv4 {

double CacheUsage::fraction() const {
  double f = 0;
  for (int k = 0; k < kNumPageKinds; ++k)
    if (pages_total[k] > 0) f = std::max(f, double(pages_used[k]) / double(pages_total[k]));
  return f;
}

PagedRunner::PagedRunner(const ModelConfig& config, const CacheConfig& cache, const Limits& limits)
    : cfg_(config), lim_(limits), blocks_(dsv4::cache_spec(config), cache) {
  lim_.max_context = std::min<int64_t>(lim_.max_context, cfg_.max_position_embeddings);
  DSV4_CHECK(lim_.max_step_tokens > 0 && lim_.max_step_seqs > 0 && lim_.max_context > 0 &&
                 lim_.max_logit_rows > 0,
             "runner limits must be positive");
}

SequenceCache& PagedRunner::sequence(int seq) {
  auto it = seqs_.find(seq);
  DSV4_CHECK(it != seqs_.end(), "unknown sequence ", seq);
  return it->second;
}

const SequenceCache& PagedRunner::sequence(int seq) const {
  auto it = seqs_.find(seq);
  DSV4_CHECK(it != seqs_.end(), "unknown sequence ", seq);
  return it->second;
}

int PagedRunner::open_sequence() {
  SequenceCache s = blocks_.begin_sequence();
  reset_states(s.state_slot);
  const int id = next_id_++;
  seqs_.emplace(id, std::move(s));
  return id;
}

int PagedRunner::fork_sequence(int src) {
  const SequenceCache& from = sequence(src);
  SequenceCache s = blocks_.fork(from);
  copy_sequence(from, s);
  const int id = next_id_++;
  seqs_.emplace(id, std::move(s));
  return id;
}

void PagedRunner::close_sequence(int seq) {
  SequenceCache& s = sequence(seq);
  blocks_.end_sequence(s);
  seqs_.erase(seq);
}

int64_t PagedRunner::length(int seq) const {
  return sequence(seq).tokens;
}

bool PagedRunner::can_append(int seq, int64_t n) const {
  auto it = seqs_.find(seq);
  return it != seqs_.end() && it->second.tokens + n <= lim_.max_context &&
         blocks_.can_append(it->second, n);
}

CacheUsage PagedRunner::usage() const {
  CacheUsage u;
  for (PageKind k : kPageKinds) {
    u.pages_total[int(k)] = blocks_.total_pages(k);
    u.pages_used[int(k)] = blocks_.total_pages(k) - blocks_.free_pages(k);
  }
  u.slots_total = blocks_.config().max_seqs;
  u.slots_used = u.slots_total - blocks_.free_state_slots();
  return u;
}

CacheUsage PagedRunner::usage_excluding(const std::vector<int>& seqs) const {
  CacheUsage u = usage();
  for (PageKind k : kPageKinds) {
    std::map<int, int> refs;  // page -> references from seqs
    for (int s : seqs)
      for (int p : sequence(s).pages[int(k)]) ++refs[p];
    for (const auto& [p, n] : refs)
      if (n == blocks_.refcount(k, p)) --u.pages_used[int(k)];
  }
  u.slots_used -= int(seqs.size());
  return u;
}

namespace {

void check_sampling(const SampleSpec& s, int vocab) {
  DSV4_CHECK(s.params != nullptr, "sample without sampling parameters");
  const SamplingParams& p = *s.params;
  DSV4_CHECK(std::isfinite(p.temperature) && p.temperature >= 0, "temperature must be >= 0");
  DSV4_CHECK(p.top_k >= 0, "top_k must be >= 0");
  DSV4_CHECK(p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1]");
  DSV4_CHECK(p.min_p >= 0 && p.min_p <= 1, "min_p must be in [0, 1]");
  DSV4_CHECK(std::isfinite(p.presence_penalty) && std::isfinite(p.frequency_penalty) &&
                 std::isfinite(p.repetition_penalty) && p.repetition_penalty > 0,
             "penalties must be finite (repetition > 0)");
  DSV4_CHECK(p.top_logprobs >= 0 && p.top_logprobs <= kMaxTopLogprobs,
             "top_logprobs must be in [0, ", kMaxTopLogprobs, "]");
  for (const auto& [t, b] : p.logit_bias)
    DSV4_CHECK(t >= 0 && t < vocab && std::isfinite(b), "logit_bias token ", t,
               " out of range [0, ", vocab, ") or not finite");
  DSV4_CHECK(s.forced < vocab, "forced token ", s.forced, " out of range");
  if (s.counts) {
    for (const auto& [t, c] : s.counts->output)
      DSV4_CHECK(t >= 0 && t < vocab && c >= 0, "token count of ", t, " out of range");
    for (int32_t t : s.counts->prompt)
      DSV4_CHECK(t >= 0 && t < vocab, "token ", t, " out of range");
  }
}

}  // namespace

std::set<int> PagedRunner::rows_of(const StepInput& in) {
  std::set<int> r;
  const int n = static_cast<int>(in.tokens.size());
  if (in.logits) {
    if (in.all_logits)
      for (int j = 0; j < n; ++j) r.insert(j);
    else
      r.insert(n - 1);
  }
  if (in.sample) r.insert(n - 1);
  for (size_t j = 0; j < in.score.size(); ++j)
    if (in.score[j] >= 0) r.insert(int(j));
  return r;
}

StepBatch PagedRunner::prepare(const std::vector<StepInput>& inputs) {
  const int V = cfg_.vocab_size;
  DSV4_CHECK(!inputs.empty(), "empty step");
  DSV4_CHECK(int(inputs.size()) <= lim_.max_step_seqs, "step of ", inputs.size(),
             " sequences exceeds the planned ", lim_.max_step_seqs);
  std::set<int> seen;
  int64_t total = 0;
  int64_t rows_wanted = 0;
  for (const auto& in : inputs) {
    DSV4_CHECK(seen.insert(in.seq).second, "sequence ", in.seq, " appears twice in one step");
    const SequenceCache& s = sequence(in.seq);
    DSV4_CHECK(!in.tokens.empty(), "empty token list for sequence ", in.seq);
    for (int32_t t : in.tokens)
      DSV4_CHECK(t >= 0 && t < V, "token id ", t, " out of range [0, ", V, ")");
    const int64_t end = s.tokens + int64_t(in.tokens.size());
    DSV4_CHECK(end <= cfg_.max_position_embeddings,
               "sequence would exceed max_position_embeddings (", cfg_.max_position_embeddings,
               ")");
    DSV4_CHECK(end <= lim_.max_context, "sequence of ", end,
               " tokens exceeds the planned context of ", lim_.max_context);
    if (in.sample) check_sampling(*in.sample, V);
    total += int64_t(in.tokens.size());
    DSV4_CHECK(in.score.empty() || in.score.size() == in.tokens.size(), "score list of ",
               in.score.size(), " ids for ", in.tokens.size(), " tokens");
    DSV4_CHECK(in.score_top >= 0 && in.score_top <= kMaxTopLogprobs, "score_top must be in [0, ",
               kMaxTopLogprobs, "]");
    for (int32_t t : in.score) DSV4_CHECK(t < V, "scored token ", t, " out of range");
    rows_wanted += int64_t(rows_of(in).size());
  }
  DSV4_CHECK(total <= lim_.max_step_tokens, "step of ", total, " tokens exceeds the planned ",
             lim_.max_step_tokens, " per step");
  DSV4_CHECK(rows_wanted <= lim_.max_logit_rows, "step wants ", rows_wanted,
             " logits rows, more than the planned ", lim_.max_logit_rows);
  // Every sequence's pages before any state changes: a step that cannot get them fails
  // without running (pages already reserved stay with their sequences).
  std::vector<PageCopy> copies;
  for (const auto& in : inputs) {
    SequenceCache& s = sequence(in.seq);
    std::vector<PageCopy> c = blocks_.reserve(s, s.tokens + int64_t(in.tokens.size()));
    copies.insert(copies.end(), c.begin(), c.end());
  }
  if (!copies.empty()) copy_pages(copies);

  StepBatch b;
  b.decode_only = true;
  int row = 0;
  for (const auto& in : inputs) {
    SequenceCache& s = sequence(in.seq);
    const int n = static_cast<int>(in.tokens.size());
    b.chunks.push_back({&s, s.tokens, in.tokens.data(), n});
    b.decode_only &= n == 1;
    if (in.logits) {
      if (in.all_logits)
        for (int j = 0; j < n; ++j) b.rows.push_back(row + j);
      else
        b.rows.push_back(row + n - 1);
    }
    b.row_input.resize(b.rows.size(), int(b.chunks.size()) - 1);
    row += n;
  }
  b.num_logit_rows = int(b.rows.size());
  // Rows sampled or scored: their index in `rows`, appending the ones not already there.
  std::map<int, int> index;
  for (int i = 0; i < b.num_logit_rows; ++i) index[b.rows[size_t(i)]] = i;
  int input = 0;
  auto at = [&](int r) {
    auto [it, fresh] = index.emplace(r, int(b.rows.size()));
    if (fresh) b.rows.push_back(r), b.row_input.push_back(input);
    return it->second;
  };
  row = 0;
  for (const auto& in : inputs) {
    const int n = static_cast<int>(in.tokens.size());
    if (in.sample) {
      b.sample_rows.push_back(at(row + n - 1));
      b.samples.push_back(in.sample);
    }
    if (!in.score.empty()) {
      StepBatch::Score sc;
      sc.ids = &in.score;
      sc.top = in.score_top;
      for (int j = 0; j < n; ++j) sc.rows.push_back(in.score[size_t(j)] >= 0 ? at(row + j) : -1);
      b.scores.push_back(std::move(sc));
    }
    row += n;
    ++input;
  }
  return b;
}

StepOutput PagedRunner::step(const std::vector<StepInput>& inputs) {
  const StepBatch b = prepare(inputs);
  StepOutput out = forward(b);
  for (const auto& in : inputs) sequence(in.seq).tokens += int64_t(in.tokens.size());
  return out;
}

}  // namespace dsv4
