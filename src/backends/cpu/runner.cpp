#include "backends/cpu/runner.h"

#include <algorithm>
#include <optional>

#include "backends/cpu/host_sampling.h"
#include "core/error.h"
#include "model/speculation.h"

namespace dsv4 {

CpuRunner::CpuRunner(const CpuModel& model, const CacheConfig& cache)
    : PagedRunner(model.config(), cache, Limits{}), model_(model), cache_(model.config(), cache) {}

void CpuRunner::copy_pages(int, const std::vector<PageCopy>& copies) {
  for (const PageCopy& c : copies) cache_.copy_page(c);
}

void CpuRunner::enable_speculation(Rollback rollback) {
  DSV4_CHECK(config().n_mtp_layers >= 1,
             "speculative decoding needs the model's MTP block (num_nextn_predict_layers is 0)");
  spec_ = true;
  rollback_ = rollback;
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

  // Rollback of rejected drafts (Rollback, model/runner.h). kRerun: every store the step wrote
  // goes back to before it and the kept tokens run again; kRestore: only the stores the
  // rejected positions changed go back. The CPU model's arithmetic per token does not depend
  // on chunking, so both leave exactly the bytes a plain run of the kept tokens leaves (window
  // slots of the rejected positions, the compressed entries and indexer keys they completed
  // and the compressor states included). The first pass's hidden rows of the kept tokens are
  // already those of the plain run.
  const std::vector<int> kept = kept_tokens(b, out);
  std::vector<ChunkRef> rerun;
  for (size_t i = 0; i < b.chunks.size(); ++i) {
    const ChunkRef& ch = b.chunks[i];
    if (!saved[i] || kept[i] == ch.n) continue;
    if (rollback_ == Rollback::kRestore) {
      cache_.restore_rejected(*ch.cache, *saved[i], kept[i]);
      continue;
    }
    cache_.restore(*ch.cache, *saved[i]);
    rerun.push_back({ch.cache, ch.start, ch.tokens, kept[i]});
  }
  if (!rerun.empty()) model_.forward(rerun, cache_, {0});
  if (spec_) mtp_after_step(b, kept, hidden.data(), out);
  if (hidden_out_) *hidden_out_ = std::move(hidden);
  return out;
}

// The MTP block's runs after a step and the chained drafts (model/speculation.h).
void CpuRunner::mtp_after_step(const StepBatch& b, const std::vector<int>& kept,
                               const float* hidden, StepOutput& out) {
  const ModelConfig& c = config();
  const int V = c.vocab_size, L = c.n_layers;
  const size_t width = size_t(c.hc_mult) * c.dim;

  // 1. The positions whose next token is now known.
  const std::vector<MtpRun> runs = mtp_runs(b, kept, out.errors);
  std::vector<ChunkRef> chunks;
  std::vector<float> h;
  for (const MtpRun& r : runs) {
    chunks.push_back(r.chunk_ref());
    const int64_t start = b.chunks[r.chunk].start;
    for (int64_t p = r.first; p < r.end; ++p) {
      const float* src = p < start ? cache_.mtp_hidden(r.seq->state_slot)
                                   : hidden + size_t(r.step_row0 + (p - start)) * width;
      h.insert(h.end(), src, src + width);
    }
  }
  if (!chunks.empty()) model_.mtp_forward(0, chunks, h.data(), cache_);
  finish_mtp(b, kept, out.errors);
  int row0 = 0;
  for (size_t i = 0; i < b.chunks.size(); row0 += b.chunks[i].n, ++i)
    if (i >= out.errors.size() || out.errors[i].empty())
      std::copy_n(hidden + size_t(row0 + kept[i] - 1) * width, width,
                  cache_.mtp_hidden(b.chunks[i].cache->state_slot));

  // 2. The drafts, chained, batched over the sequences that want them.
  struct Draft {
    DraftSeed seed;
    std::vector<float> h;
    HostCache::Span saved;
  };
  std::vector<Draft> ds;
  int most = 0;
  for (const DraftSeed& seed : draft_seeds(b, kept, out)) {
    Draft d;
    d.seed = seed;
    const float* src = cache_.mtp_hidden(seed.seq->state_slot);
    d.h.assign(src, src + width);
    d.saved = cache_.save(*seed.seq, seed.pos, seed.count, L, L + 1);
    ds.push_back(std::move(d));
    most = std::max(most, seed.count);
  }
  for (int j = 0; j < most; ++j) {
    std::vector<size_t> who;
    std::vector<ChunkRef> dc;
    std::vector<float> dh;
    for (size_t k = 0; k < ds.size(); ++k) {
      if (ds[k].seed.count <= j) continue;
      who.push_back(k);
      dc.push_back({ds[k].seed.seq, ds[k].seed.pos, &ds[k].seed.token, 1});
      dh.insert(dh.end(), ds[k].h.begin(), ds[k].h.end());
    }
    std::vector<float> streams;
    const std::vector<float> lg = model_.mtp_forward(0, dc, dh.data(), cache_, nullptr, &streams);
    for (size_t r = 0; r < who.size(); ++r) {
      DraftSeed& d = ds[who[r]].seed;
      const float* row = lg.data() + r * size_t(V);
      const int32_t best = chosen_draft(*b.samples[d.sample], d.index,
                                        int32_t(std::max_element(row, row + V) - row));
      out.drafts[d.sample].push_back(best);
      d.token = best;
      ds[who[r]].h.assign(streams.begin() + long(r * width),
                          streams.begin() + long((r + 1) * width));
      ++d.pos;
      ++d.index;
    }
  }
  for (const Draft& d : ds) cache_.restore(*d.seed.seq, d.saved);
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
