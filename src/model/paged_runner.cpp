#include "model/paged_runner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "core/error.h"
#include "model/cache_spec.h"

namespace dsv4 {

CacheUsage Runner::usage() const {
  CacheUsage u;
  for (int g = 0; g < dp_size(); ++g) {
    const CacheUsage x = usage_on(g);
    for (int k = 0; k < kNumPageKinds; ++k) {
      u.pages_used[k] += x.pages_used[k];
      u.pages_total[k] += x.pages_total[k];
    }
    u.slots_used += x.slots_used;
    u.slots_total += x.slots_total;
  }
  return u;
}

double CacheUsage::fraction() const {
  double f = 0;
  for (int k = 0; k < kNumPageKinds; ++k)
    if (pages_total[k] > 0) f = std::max(f, double(pages_used[k]) / double(pages_total[k]));
  return f;
}

PagedRunner::PagedRunner(const ModelConfig& config, const CacheConfig& cache, const Limits& limits,
                         int dp_groups)
    : cfg_(config), lim_(limits) {
  lim_.max_context = std::min<int64_t>(lim_.max_context, cfg_.max_position_embeddings);
  DSV4_CHECK(lim_.max_step_tokens > 0 && lim_.max_step_seqs > 0 && lim_.max_context > 0 &&
                 lim_.max_logit_rows > 0 && dp_groups >= 1,
             "runner limits must be positive");
  for (int g = 0; g < dp_groups; ++g)
    groups_.push_back({BlockManager(dsv4::cache_spec(config), cache), {}});
}

PagedRunner::Group& PagedRunner::group_of(int seq) {
  auto it = seq_group_.find(seq);
  DSV4_CHECK(it != seq_group_.end(), "unknown sequence ", seq);
  return groups_[size_t(it->second)];
}

const PagedRunner::Group& PagedRunner::group_of(int seq) const {
  auto it = seq_group_.find(seq);
  DSV4_CHECK(it != seq_group_.end(), "unknown sequence ", seq);
  return groups_[size_t(it->second)];
}

int PagedRunner::dp_rank(int seq) const {
  auto it = seq_group_.find(seq);
  DSV4_CHECK(it != seq_group_.end(), "unknown sequence ", seq);
  return it->second;
}

SequenceCache& PagedRunner::sequence(int seq) {
  return group_of(seq).seqs.at(seq);
}

const SequenceCache& PagedRunner::sequence(int seq) const {
  return group_of(seq).seqs.at(seq);
}

int PagedRunner::open_sequence_on(int g) {
  DSV4_CHECK(g >= 0 && g < dp_size(), "data-parallel rank ", g, " out of range [0, ", dp_size(),
             ")");
  SequenceCache s = groups_[size_t(g)].blocks.begin_sequence();
  reset_states(g, s.state_slot);
  const int id = next_id_++;
  groups_[size_t(g)].seqs.emplace(id, std::move(s));
  seq_group_[id] = g;
  return id;
}

int PagedRunner::fork_sequence(int src) {
  const int g = dp_rank(src);
  Group& gr = groups_[size_t(g)];
  const SequenceCache& from = gr.seqs.at(src);
  SequenceCache s = gr.blocks.fork(from);
  copy_sequence(g, from, s);
  const int id = next_id_++;
  gr.seqs.emplace(id, std::move(s));
  seq_group_[id] = g;
  return id;
}

int PagedRunner::clone_sequence(int src) {
  const int g = dp_rank(src);
  Group& gr = groups_[size_t(g)];
  const SequenceCache& from = gr.seqs.at(src);
  SequenceCache s = gr.blocks.begin_sequence();
  // Everything up to the copies inside the try: a failure returns the new sequence's slot and
  // pages (nothing changes).
  try {
    // A new sequence holds no page: reserving takes fresh ones and asks for no copy.
    const std::vector<PageCopy> none = gr.blocks.reserve(s, from.tokens);
    DSV4_CHECK(none.empty(), "clone_sequence: a new sequence asked for copy-on-write copies");
    std::vector<PageCopy> copies;
    for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
      const std::vector<int>& a = from.pages[int(k)];
      const std::vector<int>& b = s.pages[int(k)];
      DSV4_CHECK(a.size() >= b.size(), "clone_sequence: the source holds ", a.size(), " ",
                 page_kind_name(k), " pages for ", from.tokens, " tokens, the clone needs ",
                 b.size());
      for (size_t i = 0; i < b.size(); ++i) copies.push_back({k, a[i], b[i]});
    }
    s.tokens = from.tokens;
    s.mtp_tokens = from.mtp_tokens;
    if (!copies.empty()) copy_pages(g, copies);
    copy_sequence(g, from, s);
  } catch (...) {
    gr.blocks.end_sequence(s);
    throw;
  }
  const int id = next_id_++;
  gr.seqs.emplace(id, std::move(s));
  seq_group_[id] = g;
  return id;
}

void PagedRunner::close_sequence(int seq) {
  Group& g = group_of(seq);
  g.blocks.end_sequence(g.seqs.at(seq));
  g.seqs.erase(seq);
  seq_group_.erase(seq);
}

int64_t PagedRunner::length(int seq) const {
  return sequence(seq).tokens;
}

bool PagedRunner::can_open_on(int g) const {
  return g >= 0 && g < dp_size() && groups_[size_t(g)].blocks.can_begin();
}

bool PagedRunner::can_append(int seq, int64_t n) const {
  auto it = seq_group_.find(seq);
  if (it == seq_group_.end()) return false;
  const Group& g = groups_[size_t(it->second)];
  const SequenceCache& s = g.seqs.at(seq);
  return s.tokens + n <= lim_.max_context && g.blocks.can_append(s, n);
}

int64_t PagedRunner::pages_to_append(int seq, int64_t n, PageKind k) const {
  return group_of(seq).blocks.pages_to_append(sequence(seq), n, k);
}

CacheUsage PagedRunner::usage_on(int g) const {
  const BlockManager& bm = groups_.at(size_t(g)).blocks;
  CacheUsage u;
  for (PageKind k : kPageKinds) {
    u.pages_total[int(k)] = bm.total_pages(k);
    u.pages_used[int(k)] = bm.total_pages(k) - bm.free_pages(k);
  }
  u.slots_total = bm.config().max_seqs;
  u.slots_used = u.slots_total - bm.free_state_slots();
  return u;
}

CacheUsage PagedRunner::usage_excluding(const std::vector<int>& seqs) const {
  CacheUsage u = usage();
  // A page is free but for `seqs` when all its references are theirs. The server asks after
  // every step, with up to one prefix snapshot per running sequence, each holding a long
  // prompt's pages: the references are gathered as sorted (group, page) keys and counted by
  // runs, not one tree node per reference.
  std::vector<uint64_t> keys[kNumPageKinds];
  for (int s : seqs) {
    const uint64_t g = uint64_t(uint32_t(dp_rank(s))) << 32;
    const SequenceCache& sc = sequence(s);
    for (PageKind k : kPageKinds)
      for (int p : sc.pages[int(k)]) keys[int(k)].push_back(g | uint32_t(p));
  }
  for (PageKind k : kPageKinds) {
    std::vector<uint64_t>& ks = keys[int(k)];
    std::sort(ks.begin(), ks.end());
    for (size_t i = 0, j = 0; i < ks.size(); i = j) {
      while (j < ks.size() && ks[j] == ks[i]) ++j;
      const int g = int(ks[i] >> 32), p = int(uint32_t(ks[i]));
      if (int(j - i) == groups_[size_t(g)].blocks.refcount(k, p)) --u.pages_used[int(k)];
    }
  }
  u.slots_used -= int(seqs.size());
  return u;
}

std::set<int> PagedRunner::rows_of(const StepInput& in) {
  std::set<int> r;
  const int n = static_cast<int>(in.tokens.size());
  if (in.logits) {
    if (in.all_logits)
      for (int j = 0; j < n; ++j) r.insert(j);
    else
      r.insert(n - 1);
  }
  if (in.sample)
    for (int j = n - 1 - in.verify; j < n; ++j) r.insert(j);
  for (size_t j = 0; j < in.score.size(); ++j)
    if (in.score[j] >= 0) r.insert(int(j));
  return r;
}

StepBatch PagedRunner::prepare(int group, const std::vector<const StepInput*>& inputs) {
  const int V = cfg_.vocab_size;
  DSV4_CHECK(int(inputs.size()) <= lim_.max_step_seqs, "step of ", inputs.size(),
             " sequences exceeds the planned ", lim_.max_step_seqs,
             dp_size() > 1 ? cat(" (data-parallel rank ", group, ")") : std::string());
  int64_t total = 0;
  int64_t rows_wanted = 0;
  for (const StepInput* ip : inputs) {
    const StepInput& in = *ip;
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
    if (in.sample)
      check_sampling_request(in.sample->params, in.sample->counts, in.sample->forced, V);
    DSV4_CHECK(in.verify >= 0 && in.verify <= kMaxDraftTokens && in.draft >= 0 &&
                   in.draft <= kMaxDraftTokens,
               "verify and draft must be in [0, ", kMaxDraftTokens, "]");
    if (in.verify > 0 || in.draft > 0) {
      DSV4_CHECK(speculation_enabled(), "a speculative step (verify ", in.verify, ", draft ",
                 in.draft, ") on a runner without speculation enabled");
      DSV4_CHECK(in.sample != nullptr, "verify or draft without sampling");
      DSV4_CHECK(in.verify < int64_t(in.tokens.size()), "verify of ", in.verify,
                 " drafts needs at least one token before them, got ", in.tokens.size());
    }
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
  for (const StepInput* ip : inputs) {
    SequenceCache& s = sequence(ip->seq);
    std::vector<PageCopy> c =
        groups_[size_t(group)].blocks.reserve(s, s.tokens + int64_t(ip->tokens.size()));
    copies.insert(copies.end(), c.begin(), c.end());
  }
  if (!copies.empty()) copy_pages(group, copies);

  StepBatch b;
  b.dp_rank = group;
  b.decode_only = !inputs.empty();
  int row = 0;
  for (const StepInput* ip : inputs) {
    const StepInput& in = *ip;
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
  for (const StepInput* ip : inputs) {
    const StepInput& in = *ip;
    const int n = static_cast<int>(in.tokens.size());
    if (in.sample) {
      const int first = row + n - 1 - in.verify;
      b.sample_rows.push_back(at(first));
      b.samples.push_back(in.sample);
      b.sample_inputs.push_back(input);
      std::vector<int> more;
      for (int j = 1; j <= in.verify; ++j) more.push_back(at(first + j));
      b.verify_rows.push_back(std::move(more));
      b.drafts.push_back(in.draft);
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

std::vector<StepOutput> PagedRunner::forward_groups(const std::vector<StepBatch>& batches) {
  std::vector<StepOutput> out(batches.size());
  for (size_t g = 0; g < batches.size(); ++g)
    if (!batches[g].chunks.empty()) out[g] = forward(batches[g]);
  return out;
}

StepOutput PagedRunner::step(const std::vector<StepInput>& inputs) {
  DSV4_CHECK(!inputs.empty(), "empty step");
  // Split by data-parallel group, keeping the input order within each.
  std::vector<std::vector<const StepInput*>> by_group(groups_.size());
  std::set<int> seen;
  for (const StepInput& in : inputs) {
    DSV4_CHECK(seen.insert(in.seq).second, "sequence ", in.seq, " appears twice in one step");
    by_group[size_t(dp_rank(in.seq))].push_back(&in);
  }
  std::vector<StepBatch> batches;
  for (size_t g = 0; g < groups_.size(); ++g) batches.push_back(prepare(int(g), by_group[g]));
  std::vector<StepOutput> outs = forward_groups(batches);
  // Lengths: a verify keeps the tokens up to its last accepted draft, and returns the pages
  // reserved for the rejected ones.
  std::vector<size_t> next_sample(groups_.size(), 0);
  for (const StepInput& in : inputs) {
    const size_t g = size_t(dp_rank(in.seq));
    SequenceCache& s = sequence(in.seq);
    int64_t kept = int64_t(in.tokens.size());
    if (in.sample) {
      const size_t i = next_sample[g]++;
      if (in.verify > 0) {
        const StepOutput& o = outs[g];
        const size_t accepted = i < o.more.size() ? o.more[i].size() : 0;
        kept -= in.verify - int64_t(accepted);
      }
    }
    if (kept == int64_t(in.tokens.size()))
      s.tokens += kept;
    else
      groups_[g].blocks.truncate(s, s.tokens + kept);
  }
  if (groups_.size() == 1) return std::move(outs[0]);
  // Merge the groups' outputs back into input order.
  const int V = cfg_.vocab_size;
  StepOutput merged;
  std::vector<size_t> next_input(groups_.size(), 0), next_row(groups_.size(), 0),
      next_score(groups_.size(), 0);
  std::fill(next_sample.begin(), next_sample.end(), 0);
  for (const StepInput& in : inputs) {
    const size_t g = size_t(dp_rank(in.seq));
    StepOutput& o = outs[g];
    const size_t rows = in.logits ? (in.all_logits ? in.tokens.size() : 1) : 0;
    merged.logits.insert(merged.logits.end(), o.logits.begin() + long(next_row[g] * V),
                         o.logits.begin() + long((next_row[g] + rows) * V));
    next_row[g] += rows;
    if (in.sample) {
      const size_t i = next_sample[g]++;
      merged.samples.push_back(std::move(o.samples[i]));
      merged.more.push_back(i < o.more.size() ? std::move(o.more[i]) : std::vector<SampledToken>());
      merged.drafts.push_back(i < o.drafts.size() ? std::move(o.drafts[i])
                                                  : std::vector<int32_t>());
    }
    if (!in.score.empty()) merged.scores.push_back(std::move(o.scores[next_score[g]++]));
    merged.errors.push_back(next_input[g] < o.errors.size() ? o.errors[next_input[g]] : "");
    ++next_input[g];
  }
  return merged;
}

}  // namespace dsv4
