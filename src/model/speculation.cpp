#include "model/speculation.h"

#include <algorithm>

#include "core/error.h"
#include "model/cache_spec.h"

namespace dsv4 {

// The window slots, at most one compressed entry and indexer key per `ratio` positions (plus
// one), the states (for_each_span_store's stores).
RollbackBound rollback_span_bound(const ModelConfig& m, int first, int last, int positions) {
  RollbackBound s;
  const int64_t kv = kv_layout(m).entry_bytes(), ix = index_layout(m).entry_bytes();
  for (int b = first; b < last; ++b) {
    const int r = m.ratio(b);
    s.bytes += int64_t(positions) * kv;
    s.segments += 2 * positions;
    if (r > 0) {
      const int64_t entries = positions / r + 1;
      const CompressorStateLayout l = main_state_layout(m, b);
      // for_each_span_store: a non-overlapping state's rows of the positions, else all of it.
      // Segments: the more of the save's and a restore's; for_each_rejected_store puts an
      // overlapping state back as rows (a kv and a score row per position, the previous
      // block's rows as one kv and one score range).
      const bool rows = l.coff() == 1 && positions < l.ratio;
      s.bytes += entries * kv + (rows ? 2 * int64_t(positions) * l.width() * 4 : l.bytes());
      s.segments += 2 * entries + 2 * positions + (rows ? 0 : 2);
    }
    if (r == 4) {
      const int64_t entries = positions / 4 + 1;
      s.bytes += entries * ix + CompressorStateLayout{4, index_layout(m).dim}.bytes();
      s.segments += 2 * entries + 2 * positions + 2;
    }
  }
  s.bytes += 16 * s.segments;
  return s;
}

RollbackBound rollback_bound(const ModelConfig& m, int seqs, int main_positions,
                             int mtp_positions) {
  DSV4_CHECK(seqs > 0 && main_positions > 0 && mtp_positions > 0, "cache rollback: bad capacity");
  const RollbackBound a = rollback_span_bound(m, 0, m.n_layers, main_positions);
  const RollbackBound b = rollback_span_bound(m, m.n_layers, m.num_blocks(), mtp_positions);
  RollbackBound r;
  r.bytes = (a.bytes + b.bytes + 512) * seqs;
  r.segments = (a.segments + b.segments) * seqs * 2;  // saves and restores of every span
  return r;
}

int64_t speculation_staged_ints(int seqs, int64_t step_tokens) {
  return 4 * step_tokens + 8 * int64_t(seqs) * (kMaxDraftTokens + 2) + 64;
}

int64_t speculation_device_bytes(const ModelConfig& m, int seqs, int64_t step_tokens,
                                 int64_t context, int page_size) {
  const RollbackBound rb = rollback_bound(m, seqs, kMaxDraftTokens + 1, kMaxDraftTokens);
  const int64_t row = int64_t(m.hc_mult) * m.dim * 2;
  const int64_t segment = 24;  // glue::CopySegment: two addresses and a byte count
  auto pages = [&](int64_t entries) {
    return std::max<int64_t>(1, (entries + page_size - 1) / page_size);
  };
  // StepBuffers: 5 token arrays, 3 sequence arrays, the three block tables (16-byte padding).
  const int64_t meta_ints =
      5 * (step_tokens + 4) + 3 * (seqs + 5) +
      seqs * (pages(m.window_size) + pages(context / 4) + pages(context / 128)) + 12;
  return rb.bytes + rb.segments * segment + (step_tokens + seqs) * row +
         4 * speculation_staged_ints(seqs, step_tokens) + 2 * 4 * meta_ints;
}

int64_t device_mtp_state_bytes(const ModelConfig& m, int slots) {
  return m.n_mtp_layers > 0 ? int64_t(slots) * m.hc_mult * m.dim * 2 : 0;
}

const uint8_t* saved_copy_of(const std::vector<SavedRange>& ranges, const uint8_t* p, int64_t n) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), p,
                             [](const uint8_t* x, const SavedRange& r) { return x < r.store; });
  DSV4_CHECK(it != ranges.begin(), "rollback: a rejected position's store outside the saved span");
  --it;
  DSV4_CHECK(p + n <= it->store + it->bytes,
             "rollback: a rejected position's store outside the saved span");
  return it->copy + (p - it->store);
}

std::vector<int> kept_tokens(const StepBatch& b, const StepOutput& out) {
  std::vector<int> kept(b.chunks.size());
  for (size_t i = 0; i < b.chunks.size(); ++i) kept[i] = b.chunks[i].n;
  for (size_t i = 0; i < b.samples.size(); ++i) {
    const int v = i < b.verify_rows.size() ? int(b.verify_rows[i].size()) : 0;
    const int accepted = i < out.more.size() ? int(out.more[i].size()) : 0;
    if (v > 0) kept[size_t(b.sample_inputs[i])] -= v - accepted;
  }
  return kept;
}

namespace {

bool chunk_ok(const std::vector<std::string>& errors, size_t i) {
  return i >= errors.size() || errors[i].empty();
}

}  // namespace

std::vector<MtpRun> mtp_runs(const StepBatch& b, const std::vector<int>& kept,
                             const std::vector<std::string>& errors) {
  std::vector<MtpRun> runs;
  int row0 = 0;
  for (size_t i = 0; i < b.chunks.size(); row0 += b.chunks[i].n, ++i) {
    const ChunkRef& ch = b.chunks[i];
    SequenceCache& s = *ch.cache;
    const int64_t first = std::max<int64_t>(0, ch.start - 1), end = ch.start + kept[i] - 1;
    DSV4_CHECK(s.mtp_tokens == first, "the MTP block of a sequence at ", ch.start,
               " tokens has run ", s.mtp_tokens,
               " positions (speculation must be enabled before sequences are opened)");
    if (!chunk_ok(errors, i) || end <= first) continue;
    MtpRun r;
    r.chunk = i;
    r.seq = &s;
    r.first = first;
    r.end = end;
    r.tokens = ch.tokens + (first + 1 - ch.start);
    r.step_row0 = row0;
    runs.push_back(r);
  }
  return runs;
}

void finish_mtp(const StepBatch& b, const std::vector<int>& kept,
                const std::vector<std::string>& errors) {
  for (size_t i = 0; i < b.chunks.size(); ++i)
    if (chunk_ok(errors, i)) b.chunks[i].cache->mtp_tokens = b.chunks[i].start + kept[i] - 1;
}

std::vector<DraftSeed> draft_seeds(const StepBatch& b, const std::vector<int>& kept,
                                   const StepOutput& out) {
  std::vector<DraftSeed> ds;
  for (size_t i = 0; i < b.samples.size(); ++i) {
    const size_t in = size_t(b.sample_inputs[i]);
    if (b.drafts[i] <= 0 || !chunk_ok(out.errors, in) || out.samples[i].id < 0) continue;
    const ChunkRef& ch = b.chunks[in];
    const std::vector<SampledToken>& more = out.more[i];
    DraftSeed d;
    d.sample = i;
    d.seq = ch.cache;
    d.pos = ch.start + kept[in] - 1;
    d.token = more.empty() ? out.samples[i].id : more.back().id;
    d.index = b.samples[i]->index + 1 + int64_t(more.size());
    d.count = b.drafts[i];
    ds.push_back(d);
  }
  return ds;
}

int32_t chosen_draft(const SampleSpec& s, int64_t index, int32_t argmax) {
  if (s.draft_override && index >= 0 && index < int64_t(s.draft_override->size()))
    return (*s.draft_override)[size_t(index)];
  return argmax;
}

TokenCounts verify_counts(const TokenCounts* counts, const int32_t* drafts, int j) {
  TokenCounts c;
  if (counts) c = *counts;
  for (int i = 0; i < j; ++i) {
    auto it = std::find_if(c.output.begin(), c.output.end(),
                           [&](const auto& e) { return e.first == drafts[i]; });
    if (it == c.output.end())
      c.output.emplace_back(drafts[i], 1);
    else
      ++it->second;
  }
  return c;
}

int32_t verify_forced(const SampleSpec& s, int j) {
  if (j == 0) return s.forced;
  const int64_t index = s.index + j;
  return s.forced_from && index < int64_t(s.forced_from->size()) ? (*s.forced_from)[size_t(index)]
                                                                 : -1;
}

std::vector<SampledToken> accepted_chain(const SampledToken& first,
                                         const std::vector<SampledToken>& rows,
                                         const int32_t* drafts) {
  std::vector<SampledToken> more;
  const SampledToken* last = &first;
  for (size_t j = 0; j < rows.size(); ++j) {
    if (last->id != drafts[j]) break;  // rejected: `last` replaces the draft
    more.push_back(rows[j]);
    last = &rows[j];
  }
  return more;
}

}  // namespace dsv4
