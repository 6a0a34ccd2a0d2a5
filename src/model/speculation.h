// Speculative decoding's backend-neutral logic, shared by the CPU and CUDA runners: what a
// verify keeps, which stores a step overwrites (and so must save for a rollback), the MTP
// block's bookkeeping (which positions it runs after a step, where the drafts start) and the
// acceptance rule over samples drawn for every verified row. A backend supplies the bytes
// (host copies or device-to-device copies into a preallocated area) and the forward passes.
//
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
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "kvcache/block_manager.h"
#include "kvcache/cache_layout.h"
#include "model/model_config.h"
#include "model/runner.h"
#include "model/step.h"

namespace dsv4 {

// Per chunk of the batch: the tokens the sequence keeps (a verify drops its rejected drafts).
// `out.more` must hold the verify results (one list per sample).
std::vector<int> kept_tokens(const StepBatch& b, const StepOutput& out);

// The stores a forward over positions [start, start + n) of blocks [first, last) overwrites.
struct CacheSpan {
  int first = 0, last = 0;
  int64_t start = 0;
  int n = 0;
};

// Calls entry(EntryRef, data_bytes, scale_bytes) for every window-ring slot of the span's
// positions and every compressed entry and indexer key they complete, then
// state(float*, floats) for the compressor-state bytes of the sequence's slot the positions
// can change, in one fixed order (save and restore walk the same). `Cache` is HostCache or
// DeviceCache (same accessors).
template <typename Cache, typename Entry, typename State>
void for_each_span_store(Cache& c, const ModelConfig& m, const SequenceCache& s,
                         const CacheSpan& sp, Entry entry, State state) {
  const KvEntryLayout& kv = c.kv_layout();
  const IndexKeyLayout& ix = c.index_layout();
  for (int b = sp.first; b < sp.last; ++b) {
    for (int64_t p = sp.start; p < sp.start + sp.n; ++p)
      entry(c.window_slot(b, s, p), kv.data_bytes(), kv.scale_bytes());
    const int ratio = m.ratio(b);
    if (ratio == 0) continue;
    for (int64_t p = sp.start; p < sp.start + sp.n; ++p) {
      if ((p + 1) % ratio != 0) continue;
      entry(c.compressed(b, s, (p + 1) / ratio - 1), kv.data_bytes(), kv.scale_bytes());
      if (ratio == 4)
        entry(c.index_key(b, s, (p + 1) / ratio - 1), ix.data_bytes(), ix.scale_bytes());
    }
  }
  for (int b = sp.first; b < sp.last; ++b) {
    if (m.ratio(b) > 0) {
      const CompressorStateLayout l = c.main_state_layout(b);
      float* st = c.main_state(b, s.state_slot);
      if (l.coff() == 1 && sp.n < l.ratio) {
        // Without overlap a token writes only its row (position % ratio) of kv and score,
        // and pooling leaves the state as it is (ops/cpu/compressor.h).
        for (int64_t p = sp.start; p < sp.start + sp.n; ++p) {
          const int row = int(p % l.ratio);
          state(st + l.kv_offset(row), int64_t(l.width()));
          state(st + l.score_offset(row), int64_t(l.width()));
        }
      } else {
        state(st, l.floats());  // ratio 4 shifts its rows when a block completes
      }
    }
    if (m.ratio(b) == 4) state(c.index_state(b, s.state_slot), c.index_state_layout().floats());
  }
}

// Rollback::kRestore: calls bytes(uint8_t* store, int64_t bytes) for exactly the stores that
// the span's rejected positions [sp.start + kept, sp.start + sp.n) changed, each a range inside
// one of for_each_span_store's stores (so that a saved copy of the span holds its bytes before
// the step): their window slots, the compressed entries and indexer keys they completed, and
// of each compressor state (main and indexer) the rows below. Putting these back leaves what a
// run of the kept positions alone leaves, when that run's per-position values are the verify's:
//  - a state without overlap (ratio 128) holds one kv and one score row per position of the
//    block (row p % ratio) and pooling leaves it as it is: the rejected positions' rows;
//  - an overlapping state (ratio 4: previous-block rows [0, 4), current [4, 8)) takes position
//    p in current row p % 4, and a block's end moves the current rows into the previous ones
//    (the current rows keep their bytes). A span of at most 4 positions holds at most one
//    block end e. Rejected rows go back to their saved bytes: a rejected p after a kept e
//    writes the row that p - 4 wrote before the step (p - 4 < sp.start), which the kept run's
//    move left in place; a rejected p before e writes the row the kept run never wrote. If e
//    is itself rejected, the previous-block rows go back too (the kept run moved nothing);
//    the kept positions' rows are never written by a rejected position (a rejected p's row
//    belongs to p - 4 or p + 4, outside the kept positions of a 4-position span).
// Needs sp.n <= ratio for every compressed block (a verify: at most kMaxDraftTokens + 1 positions).
template <typename Cache, typename Bytes>
void for_each_rejected_store(Cache& c, const ModelConfig& m, const SequenceCache& s,
                             const CacheSpan& sp, int kept, Bytes bytes) {
  DSV4_CHECK(kept >= 0 && kept <= sp.n, "rollback: ", kept, " kept of ", sp.n, " positions");
  const KvEntryLayout& kv = c.kv_layout();
  const IndexKeyLayout& ix = c.index_layout();
  const int64_t r0 = sp.start + kept, r1 = sp.start + sp.n;
  auto entry = [&](auto e, int64_t data, int64_t scales) {  // EntryRef of the Cache
    bytes(e.data, data);
    bytes(e.scales, scales);
  };
  auto rows = [&](const CompressorStateLayout& l, float* st) {
    DSV4_CHECK(sp.n <= l.ratio, "rollback: ", sp.n, " positions span more than one block end of a ",
               l.ratio, "-token compressor state");
    const int64_t row_bytes = int64_t(l.width()) * int64_t(sizeof(float));
    auto row = [&](int r) {
      bytes(reinterpret_cast<uint8_t*>(st + l.kv_offset(r)), row_bytes);
      bytes(reinterpret_cast<uint8_t*>(st + l.score_offset(r)), row_bytes);
    };
    const int cur = l.coff() == 2 ? l.ratio : 0;
    bool ended = false;
    for (int64_t p = r0; p < r1; ++p) {
      row(cur + int(p % l.ratio));
      ended = ended || (p + 1) % l.ratio == 0;
    }
    if (l.coff() == 2 && ended) {  // the previous-block rows: one kv and one score range
      bytes(reinterpret_cast<uint8_t*>(st + l.kv_offset(0)), l.ratio * row_bytes);
      bytes(reinterpret_cast<uint8_t*>(st + l.score_offset(0)), l.ratio * row_bytes);
    }
  };
  for (int b = sp.first; b < sp.last; ++b) {
    for (int64_t p = r0; p < r1; ++p)
      entry(c.window_slot(b, s, p), kv.data_bytes(), kv.scale_bytes());
    const int ratio = m.ratio(b);
    if (ratio == 0) continue;
    for (int64_t p = r0; p < r1; ++p) {
      if ((p + 1) % ratio != 0) continue;
      entry(c.compressed(b, s, (p + 1) / ratio - 1), kv.data_bytes(), kv.scale_bytes());
      if (ratio == 4)
        entry(c.index_key(b, s, (p + 1) / ratio - 1), ix.data_bytes(), ix.scale_bytes());
    }
    rows(c.main_state_layout(b), c.main_state(b, s.state_slot));
    if (ratio == 4) rows(c.index_state_layout(), c.index_state(b, s.state_slot));
  }
}

// A saved span's copy of a store range: `ranges` are the span's saved pieces (store address,
// copy address, bytes) sorted by store address; [p, p + n) must lie inside one of them.
struct SavedRange {
  const uint8_t* store = nullptr;
  const uint8_t* copy = nullptr;
  int64_t bytes = 0;
};
const uint8_t* saved_copy_of(const std::vector<SavedRange>& ranges, const uint8_t* p, int64_t n);

// The save area a rollback needs (backends/cuda/cache_rollback.h), planned up front: upper
// bounds of the bytes (each piece 16-byte aligned, each span 256-byte aligned) and of the copy
// segments (saves and restores) for `seqs` sequences, each with one span of `main_positions`
// positions over the decoder blocks and one of `mtp_positions` over the MTP block(s). The
// memory plan counts the same figures.
struct RollbackBound {
  int64_t bytes = 0, segments = 0;
};
RollbackBound rollback_bound(const ModelConfig& m, int seqs, int main_positions, int mtp_positions);
// One span of `positions` positions over blocks [first, last) (rollback_bound's parts).
RollbackBound rollback_span_bound(const ModelConfig& m, int first, int last, int positions);

// Device bytes of the CUDA runner's speculation buffers (backends/cuda/runner.cpp's Spec),
// what the memory plan counts: the rollback's save area and copy segments (rollback_bound for
// `seqs` sequences of kMaxDraftTokens + 1 positions and kMaxDraftTokens MTP positions), the MTP
// steps' input rows [step_tokens, hc, dim] and the drafts' streams [seqs, hc, dim] (BF16), the
// staged ids, and two step-metadata buffers for steps of `context` tokens in pages of
// `page_size`.
int64_t speculation_device_bytes(const ModelConfig& m, int seqs, int64_t step_tokens,
                                 int64_t context, int page_size);
// The ids the CUDA runner stages per step (Spec::ints): MTP row sources and the states'
// update, twice (target and rerun), the drafts' gathers.
int64_t speculation_staged_ints(int seqs, int64_t step_tokens);
// Device bytes of the MTP state (DeviceCache::mtp_hidden: BF16 streams [hc, dim] per state
// slot), 0 for a model without an MTP block.
int64_t device_mtp_state_bytes(const ModelConfig& m, int slots);

// The MTP rows a step runs for chunk `chunk` (positions [first, end), first >= 0): the
// positions whose next token the step made known. Row p takes the token at p + 1 (tokens)
// and the main model's streams at p: position chunk.start - 1 from the sequence's MTP state,
// the others from the step's row `step_row0 + (p - chunk.start)`.
struct MtpRun {
  size_t chunk = 0;
  SequenceCache* seq = nullptr;
  int64_t first = 0, end = 0;
  const int32_t* tokens = nullptr;
  int step_row0 = 0;  // the step's token row of position chunk.start
  int n() const { return int(end - first); }
  ChunkRef chunk_ref() const { return {seq, first, tokens, n()}; }
};
// Every chunk without an error (`errors`, per chunk, may be shorter). Checks that the MTP
// block has run exactly the positions before the chunk. After the runs, finish_mtp() sets
// each sequence's MTP length; the backend keeps the streams of row kept - 1 as its state.
std::vector<MtpRun> mtp_runs(const StepBatch& b, const std::vector<int>& kept,
                             const std::vector<std::string>& errors);
void finish_mtp(const StepBatch& b, const std::vector<int>& kept,
                const std::vector<std::string>& errors);

// One sequence's drafting after a step: the MTP rows at pos, pos + 1, ... (count of them),
// the first with `token` (the token just emitted) and the sequence's MTP state as streams.
struct DraftSeed {
  size_t sample = 0;  // index into b.samples / out.drafts
  SequenceCache* seq = nullptr;
  int64_t pos = 0;
  int32_t token = 0;
  int64_t index = 0;  // output index the first draft proposes
  int count = 0;
};
std::vector<DraftSeed> draft_seeds(const StepBatch& b, const std::vector<int>& kept,
                                   const StepOutput& out);
// The draft proposed for output index `index`: the MTP block's argmax, or the test facility's
// override (SampleSpec::draft_override).
int32_t chosen_draft(const SampleSpec& s, int64_t index, int32_t argmax);

// A verify sampled on every row at once (a backend that samples rows in parallel): row j
// (j >= 1) must be drawn at output index s.index + j with the penalty history of the samples
// before it — which, when it counts at all, are the drafts before it — so the history is
// verify_counts(s.counts, drafts, j) and the forced id verify_forced(s, j).
TokenCounts verify_counts(const TokenCounts* counts, const int32_t* drafts, int j);
int32_t verify_forced(const SampleSpec& s, int j);
// The emitted tokens after `first`: row j's sample counts while the one before equals draft
// j - 1 (the acceptance rule of verify_samples, host_sampling.h). `rows[j - 1]` is row j's.
std::vector<SampledToken> accepted_chain(const SampledToken& first,
                                         const std::vector<SampledToken>& rows,
                                         const int32_t* drafts);

}  // namespace dsv4
