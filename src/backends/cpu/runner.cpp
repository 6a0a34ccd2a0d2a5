#include "backends/cpu/runner.h"

#include <algorithm>
#include <optional>

#include "backends/cpu/host_sampling.h"
#include "core/error.h"

namespace dsv4 {

CpuRunner::CpuRunner(const CpuModel& model, const CacheConfig& cache)
    : PagedRunner(model.config(), cache, Limits{}), model_(model), cache_(model.config(), cache) {}

void CpuRunner::copy_pages(int, const std::vector<PageCopy>& copies) {
  for (const PageCopy& c : copies) cache_.copy_page(c);
}

void CpuRunner::enable_speculation() {
  DSV4_CHECK(config().n_mtp_layers >= 1,
             "speculative decoding needs the model's MTP block (num_nextn_predict_layers is 0)");
  spec_ = true;
}

StepOutput CpuRunner::forward(const StepBatch& b) {
  const int V = config().vocab_size, L = config().n_layers;
  // A verify may be rejected: what its positions overwrite is saved first.
  std::vector<std::optional<HostCache::Span>> saved(b.chunks.size());
  for (size_t i = 0; i < b.samples.size(); ++i)
    if (!b.verify_rows[i].empty()) {
      const ChunkRef& ch = b.chunks[size_t(b.sample_inputs[i])];
      saved[size_t(b.sample_inputs[i])] = cache_.save(*ch.cache, ch.start, ch.n, 0, L);
    }
  std::vector<int> bad;  // per token row: the first block with non-finite output, or -1
  std::vector<float> hidden;
  std::vector<float> logits = model_.forward(b.chunks, cache_, b.rows, trace_,
                                             spec_ || hidden_out_ ? &hidden : nullptr, &bad);
  StepOutput out = sample_on_host(b, logits.data(), V, nonfinite_errors(config(), b, bad));
  logits.resize(size_t(b.num_logit_rows) * V);
  out.logits = std::move(logits);

  // Rollback of rejected drafts: every store the step wrote goes back to before it, and the
  // kept tokens run again. The CPU model's arithmetic per token does not depend on chunking,
  // so this leaves exactly the bytes a plain run of the kept tokens leaves (window slots of
  // the rejected positions, the compressed entries and indexer keys they completed and the
  // compressor states included). The first pass's hidden rows of the kept tokens are
  // already those of the plain run.
  std::vector<int> kept(b.chunks.size());
  for (size_t i = 0; i < b.chunks.size(); ++i) kept[i] = b.chunks[i].n;
  for (size_t i = 0; i < b.samples.size(); ++i) {
    const int v = int(b.verify_rows[i].size());
    if (v > 0) kept[size_t(b.sample_inputs[i])] -= v - int(out.more[i].size());
  }
  std::vector<ChunkRef> rerun;
  for (size_t i = 0; i < b.chunks.size(); ++i) {
    const ChunkRef& ch = b.chunks[i];
    if (!saved[i] || kept[i] == ch.n) continue;
    cache_.restore(*ch.cache, *saved[i]);
    rerun.push_back({ch.cache, ch.start, ch.tokens, kept[i]});
  }
  if (!rerun.empty()) model_.forward(rerun, cache_, {0});
  if (spec_) mtp_after_step(b, kept, hidden.data(), out);
  if (hidden_out_) *hidden_out_ = std::move(hidden);
  return out;
}

// The MTP block, as the reference composes it (v4_arch.md section 9): the row for position p
// takes the main model's last-layer streams at p and the embedding of the token at p + 1, and
// predicts the token at p + 2; its own window ring holds the positions it ran. A sequence of
// length n keeps positions [0, n - 1) in that ring (the ones whose next token is in the
// cache) and the streams of position n - 1 in its state slot, so the MTP state is a function
// of the cached tokens alone (prefix-cache snapshots and forks carry it). The drafts after a
// step: position n - 1 with the token just emitted gives draft 1; drafts 2 and 3 chain the
// block on itself, position n + j - 1 with draft j and, as the hidden input, the block's own
// output streams of the previous draft. The spec defines one MTP step only; the chaining is
// vLLM's and SGLang's use of a one-layer MTP for k > 1 (unsure whether DeepSeek meant the
// block's output streams or something else there). The drafts' ring slots are put back
// after drafting: their positions run again, with the main model's streams, once verified.
void CpuRunner::mtp_after_step(const StepBatch& b, const std::vector<int>& kept,
                               const float* hidden, StepOutput& out) {
  const ModelConfig& c = config();
  const int V = c.vocab_size, L = c.n_layers;
  const size_t width = size_t(c.hc_mult) * c.dim;
  std::vector<int> row0(b.chunks.size(), 0);
  for (size_t i = 1; i < b.chunks.size(); ++i) row0[i] = row0[i - 1] + b.chunks[i - 1].n;
  auto ok = [&](size_t i) { return i >= out.errors.size() || out.errors[i].empty(); };

  // 1. The positions whose next token is now known.
  std::vector<ChunkRef> chunks;
  std::vector<float> h;
  for (size_t i = 0; i < b.chunks.size(); ++i) {
    const ChunkRef& ch = b.chunks[i];
    SequenceCache& s = *ch.cache;
    const int64_t first = std::max<int64_t>(0, ch.start - 1), end = ch.start + kept[i];
    DSV4_CHECK(s.mtp_tokens == first, "the MTP block of a sequence at ", ch.start,
               " tokens has run ", s.mtp_tokens,
               " positions (speculation must be enabled before sequences are opened)");
    if (!ok(i) || end - 1 <= first) continue;
    chunks.push_back({&s, first, ch.tokens + (first + 1 - ch.start), int(end - 1 - first)});
    for (int64_t p = first; p < end - 1; ++p) {
      const float* src = p < ch.start ? cache_.mtp_hidden(s.state_slot)
                                      : hidden + size_t(row0[i] + (p - ch.start)) * width;
      h.insert(h.end(), src, src + width);
    }
  }
  if (!chunks.empty()) model_.mtp_forward(0, chunks, h.data(), cache_);
  for (size_t i = 0; i < b.chunks.size(); ++i) {
    const ChunkRef& ch = b.chunks[i];
    if (!ok(i)) continue;
    const int64_t end = ch.start + kept[i];
    ch.cache->mtp_tokens = end - 1;
    std::copy_n(hidden + size_t(row0[i] + kept[i] - 1) * width, width,
                cache_.mtp_hidden(ch.cache->state_slot));
  }

  // 2. The drafts, chained, batched over the sequences that want them.
  struct Draft {
    size_t sample;
    SequenceCache* seq;
    int64_t pos;    // MTP position of the next draft row
    int32_t token;  // the token after `pos`
    int64_t index;  // output index the next draft proposes
    std::vector<float> h;
    HostCache::Span saved;
  };
  std::vector<Draft> ds;
  int most = 0;
  for (size_t i = 0; i < b.samples.size(); ++i) {
    const size_t in = size_t(b.sample_inputs[i]);
    if (b.drafts[i] <= 0 || !ok(in) || out.samples[i].id < 0) continue;
    const ChunkRef& ch = b.chunks[in];
    const int64_t n = ch.start + kept[in];
    Draft d;
    d.sample = i;
    d.seq = ch.cache;
    d.pos = n - 1;
    d.token = out.more[i].empty() ? out.samples[i].id : out.more[i].back().id;
    d.index = b.samples[i]->index + 1 + int64_t(out.more[i].size());
    const float* src = cache_.mtp_hidden(ch.cache->state_slot);
    d.h.assign(src, src + width);
    d.saved = cache_.save(*ch.cache, d.pos, b.drafts[i], L, L + 1);
    ds.push_back(std::move(d));
    most = std::max(most, b.drafts[i]);
  }
  for (int j = 0; j < most; ++j) {
    std::vector<size_t> who;
    std::vector<ChunkRef> dc;
    std::vector<float> dh;
    for (size_t k = 0; k < ds.size(); ++k) {
      if (b.drafts[ds[k].sample] <= j) continue;
      who.push_back(k);
      dc.push_back({ds[k].seq, ds[k].pos, &ds[k].token, 1});
      dh.insert(dh.end(), ds[k].h.begin(), ds[k].h.end());
    }
    std::vector<float> streams;
    const std::vector<float> lg = model_.mtp_forward(0, dc, dh.data(), cache_, nullptr, &streams);
    for (size_t r = 0; r < who.size(); ++r) {
      Draft& d = ds[who[r]];
      const float* row = lg.data() + r * size_t(V);
      int32_t best = int32_t(std::max_element(row, row + V) - row);
      const SampleSpec& s = *b.samples[d.sample];
      if (s.draft_override && d.index < int64_t(s.draft_override->size()))
        best = (*s.draft_override)[size_t(d.index)];
      out.drafts[d.sample].push_back(best);
      d.token = best;
      d.h.assign(streams.begin() + long(r * width), streams.begin() + long((r + 1) * width));
      ++d.pos;
      ++d.index;
    }
  }
  for (const Draft& d : ds) cache_.restore(*d.seq, d.saved);
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
