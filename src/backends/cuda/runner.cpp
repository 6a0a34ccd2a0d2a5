#include "backends/cuda/runner.h"

#include <algorithm>
#include <set>

#include "backends/cpu/host_sampling.h"
#include "backends/cuda/cache_rollback.h"
#include "backends/cuda/glue.h"
#include "backends/cuda/verify.h"
#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4 {
namespace {

PagedRunner::Limits runner_limits(const CudaModel& m, const CacheConfig& c) {
  PagedRunner::Limits l;
  l.max_step_tokens = m.limits().max_tokens;
  l.max_step_seqs = std::min(m.limits().max_seqs, c.max_seqs);
  l.max_context = m.limits().max_context;
  l.max_logit_rows = m.limits().max_logit_rows;
  return l;
}

}  // namespace

CudaRunner::CudaRunner(CudaModel& model, const CacheConfig& cache, const CudaRunnerOptions& o)
    : PagedRunner(model.config(), cache, runner_limits(model, cache)),
      model_(model),
      cache_(model.config(), cache, /*extra_seqs=*/1),
      meta_(step_limits(model.config(), model.limits(), cache), model.config().window_size),
      opt_(o),
      sampler_(model.config().vocab_size, model.limits().max_logit_rows,
               // A verify samples each of its rows.
               std::max(std::min(model.limits().max_seqs, cache.max_seqs),
                        std::min(model.limits().max_logit_rows,
                                 std::min(model.limits().max_seqs, cache.max_seqs) *
                                     (kMaxDraftTokens + 1)))) {
  scratch_.state_slot = cache_.extra_slot(0);
  scratch_.pages[int(PageKind::kWindow)] = cache_.extra_window_pages(0);
  const size_t n = size_t(model.limits().max_logit_rows) * size_t(model.config().vocab_size);
  DSV4_CUDA_CHECK(cudaMallocHost(&host_logits_, n * sizeof(float)));
  for (cudaEvent_t& e : slice_done_)
    DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

// Speculation's buffers, planned for the largest step when it is enabled.
struct CudaRunner::Spec {
  Spec(const CudaModel& m, int seqs, const StepLimits& limits)
      : rollback(m.config(), seqs, kMaxDraftTokens + 1, kMaxDraftTokens),
        meta{StepBuffers(limits, m.config().window_size),
             StepBuffers(limits, m.config().window_size)},
        rows(size_t(limits.max_tokens) * m.config().hc_mult * m.config().dim),
        draft(size_t(seqs) * m.config().hc_mult * m.config().dim),
        ints(size_t(ints_capacity(limits))) {
    DSV4_CUDA_CHECK(cudaMallocHost(&host_ints, ints.size() * sizeof(int32_t)));
    // A graph's padding rows read rows past the step's: finite from the start.
    rows.fill_bytes(0);
    draft.fill_bytes(0);
  }
  ~Spec() {
    if (host_ints) cudaFreeHost(host_ints);
  }
  // The memory plan counts these buffers (speculation_device_bytes, model/speculation.h).
  static int64_t ints_capacity(const StepLimits& l) {
    return speculation_staged_ints(l.max_seqs, l.max_tokens);
  }
  CacheRollback rollback;
  // The MTP steps' metadata: [0] the block's run over the step's positions, [1] the draft
  // steps (a captured graph reads the buffer it was captured with).
  StepBuffers meta[2];
  cuda::DeviceBuffer<__nv_bfloat16> rows;   // [max_tokens, hc, dim] MTP input streams
  cuda::DeviceBuffer<__nv_bfloat16> draft;  // [seqs, hc, dim] chained drafts' streams
  cuda::DeviceBuffer<int32_t> ints;
  int32_t* host_ints = nullptr;
  size_t ints_used = 0;
  SamplingParams greedy;
};

CudaRunner::~CudaRunner() {
  for (auto& [key, g] : graphs_) {
    if (g.exec) cudaGraphExecDestroy(g.exec);
    if (g.graph) cudaGraphDestroy(g.graph);
  }
  for (cudaEvent_t e : slice_done_)
    if (e) cudaEventDestroy(e);
  if (host_logits_) cudaFreeHost(host_logits_);
}

void CudaRunner::recycle(StepOutput&& used) {
  if (used.logits.capacity() > spare_logits_.capacity()) spare_logits_ = std::move(used.logits);
}

void CudaRunner::enable_speculation(Rollback rollback) {
  DSV4_CHECK(config().n_mtp_layers >= 1,
             "speculative decoding needs the model's MTP block (num_nextn_predict_layers is 0)");
  // Verify mode checks each op against the stores it saw; the rollback's restores and reruns
  // are not ops it follows.
  DSV4_CHECK(!verify_, "speculative decoding is not offered in verify mode (--verify)");
  rollback_ = rollback;
  if (spec_) return;
  spec_ = std::make_unique<Spec>(model_, limits().max_step_seqs, meta_.limits());
}

const int32_t* CudaRunner::upload_ints(const std::vector<int32_t>& v) {
  Spec& sp = *spec_;
  DSV4_CHECK(sp.ints_used + v.size() <= sp.ints.size(), "speculation: ", sp.ints_used + v.size(),
             " staged ids, planned ", sp.ints.size());
  int32_t* h = sp.host_ints + sp.ints_used;
  std::copy(v.begin(), v.end(), h);
  int32_t* d = sp.ints.data() + sp.ints_used;
  if (!v.empty())
    DSV4_CUDA_CHECK(
        cudaMemcpyAsync(d, h, v.size() * sizeof(int32_t), cudaMemcpyHostToDevice, model_.stream()));
  sp.ints_used += (v.size() + 3) / 4 * 4;
  return d;
}

void CudaRunner::set_verifier(CudaVerifier* v) {
  DSV4_CHECK(!v || !spec_, "verify mode (--verify) is not offered with speculative decoding");
  verify_ = v;
  model_.set_verifier(v);
}

CudaRunner::Owned::Owned() = default;
CudaRunner::Owned::~Owned() = default;

void CudaRunner::adopt(std::unique_ptr<Owned> owned) {
  owned_ = std::move(owned);
}

void CudaRunner::copy_pages(int, const std::vector<PageCopy>& copies) {
  for (const PageCopy& c : copies) cache_.copy_page(c, model_.stream());
}

std::string CudaRunner::report() const {
  return verify_ ? verify_->summary() : std::string();
}

// The end of the context bucket of a decode step: the next power of two >= 1024 of its
// largest position + 1, capped by the planned context.
int64_t CudaRunner::bucket(const std::vector<ChunkRef>& chunks) const {
  return decode_bucket(chunks, model_.limits().max_context);
}

const __nv_bfloat16* CudaRunner::run_graph(Pass pass, StepBuffers& meta,
                                           const std::vector<ChunkRef>& chunks,
                                           const std::vector<int>& rows,
                                           const __nv_bfloat16* mtp_in, size_t saves) {
  const int64_t end = bucket(chunks);
  const cudaStream_t stream = model_.stream();
  const DeviceStep st = meta.build(chunks, rows, end - 1, stream);
  GraphKey key;
  key.pass = pass;
  for (const ChunkRef& c : chunks) key.tokens.push_back(c.n);
  key.rows = int(rows.size());
  key.end = end;
  key.saves = saves;
  if (auto it = graphs_.find(key); it != graphs_.end()) {
    DSV4_CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream));
    if (saves) spec_->rollback.flushed_by_graph();
    ++replays_;
    if (*std::max_element(key.tokens.begin(), key.tokens.end()) > 1) ++shaped_replays_;
    return it->second.hidden;
  }
  auto run = [&] {
    if (saves) spec_->rollback.flush(stream);
    pass_forward(pass, st, mtp_in);
  };
  // Shapes seen once and never again (mixed acceptance) are forgotten now and then.
  if (seen_.size() > size_t(16 * kMaxShapedGraphs)) seen_.clear();
  if (seen_[key]++ == 0) {
    run();  // warm-up: kernels set their attributes outside the capture
    return model_.hidden();
  }
  Graph g;
  DSV4_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    run();
  } catch (const std::exception& e) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream, &broken);
    if (broken) cudaGraphDestroy(broken);
    cudaGetLastError();
    throw Error(cat("capturing the ", pass == Pass::kTarget ? "target" : "MTP", " step of ",
                    chunks.size(), " sequences as a CUDA graph failed (run without CUDA graphs to ",
                    "bypass): ", e.what()));
  }
  g.hidden = model_.hidden();  // a replay leaves its streams where the capture did
  DSV4_CUDA_CHECK(cudaStreamEndCapture(stream, &g.graph));
  DSV4_CUDA_CHECK(cudaGraphInstantiate(&g.exec, g.graph, 0));
  graphs_[key] = g;
  if (*std::max_element(key.tokens.begin(), key.tokens.end()) > 1) ++shaped_graphs_;
  DSV4_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
  return g.hidden;
}

void CudaRunner::pass_forward(Pass pass, const DeviceStep& st, const __nv_bfloat16* mtp_in) {
  if (pass == Pass::kTarget)
    model_.forward(st, cache_);
  else  // the MTP block's run only writes its cache: its logits are never used
    model_.mtp_forward(0, st, mtp_in, cache_, /*logits=*/pass == Pass::kMtpDraft);
}

int CudaRunner::graph_size(const std::vector<ChunkRef>& chunks, int rows) const {
  const int n = int(chunks.size());
  const auto it = opt_.graph_batch_sizes.lower_bound(n);
  if (it == opt_.graph_batch_sizes.end()) return 0;
  if (*it == n) return n;
  int tokens = 0;
  for (const ChunkRef& c : chunks) tokens += c.n;
  const int pad = *it - n;
  const CudaModelLimits& l = model_.limits();
  const bool fits = *it <= limits().max_step_seqs && tokens + pad <= l.max_tokens &&
                    rows + pad <= (l.max_logit_rows > 0 ? l.max_logit_rows : l.max_tokens);
  return opt_.pad_to_graph_sizes && fits ? *it : 0;
}

const __nv_bfloat16* CudaRunner::run_pass(Pass pass, StepBuffers& meta,
                                          const std::vector<ChunkRef>& chunks,
                                          const std::vector<int>& rows, bool shaped,
                                          const __nv_bfloat16* mtp_in, size_t saves) {
  int most = 0;
  for (const ChunkRef& c : chunks) most = std::max(most, c.n);
  const bool graph_shape = most == 1 || (shaped && most <= kMaxDraftTokens + 1);
  const int padded = graph_shape ? graph_size(chunks, int(rows.size())) : 0;
  bool capped = false;  // a graph's shape past the cap: eager with the graphs' launch bound
  if (opt_.cuda_graphs && !model_.observed() && padded > 0) {
    // Dummy rows after the real ones (token 0 at position 0 of the scratch sequence), each with
    // a logits row after the real rows: the graph's shapes, and the real rows come first.
    static const int32_t kToken = 0;
    std::vector<ChunkRef> all = chunks;
    std::vector<int> all_rows = rows;
    int tokens = 0;
    for (const ChunkRef& c : chunks) tokens += c.n;
    for (int i = int(chunks.size()); i < padded; ++i) {
      all.push_back({&scratch_, 0, &kToken, 1});
      all_rows.push_back(tokens++);
    }
    if (most > 1 && shaped_graphs_ >= kMaxShapedGraphs) {
      GraphKey key;
      key.pass = pass;
      for (const ChunkRef& c : all) key.tokens.push_back(c.n);
      key.rows = int(all_rows.size());
      key.end = bucket(all);
      key.saves = saves;
      capped = !graphs_.count(key);
    }
    if (!capped) {
      if (padded > int(chunks.size())) ++padded_;
      return run_graph(pass, meta, all, all_rows, mtp_in, saves);
    }
    ++eager_shaped_;
  }
  const int64_t bound =
      graph_shape && (opt_.bucket_eager_decode || capped) ? bucket(chunks) - 1 : -1;
  const DeviceStep st = meta.build(chunks, rows, bound, model_.stream());
  if (saves) spec_->rollback.flush(model_.stream());
  pass_forward(pass, st, mtp_in);
  return model_.hidden();
}

StepOutput CudaRunner::forward(const StepBatch& b) {
  const std::vector<ChunkRef>& chunks = b.chunks;
  const cudaStream_t stream = model_.stream();
  const int L = config().n_layers;
  // A verify brings its drafts after one token (the rollback's save area is planned for
  // kMaxDraftTokens + 1 positions per sequence).
  for (size_t i = 0; i < b.verify_rows.size(); ++i)
    DSV4_CHECK(b.verify_rows[i].empty() ||
                   chunks[size_t(b.sample_inputs[i])].n == int(b.verify_rows[i].size()) + 1,
               "a verify on the CUDA backend brings its drafts after exactly one token, got ",
               chunks[size_t(b.sample_inputs[i])].n, " tokens for ", b.verify_rows[i].size(),
               " drafts");
  // The sampling requests are validated and staged before the forward pass runs. A verify
  // samples every one of its rows at once (model/speculation.h: row j with the drafts before
  // it in its penalty history); `verify_first[i]` is sample i's first verify row's result.
  std::vector<cuda::DeviceSampler::Sample> samples;
  std::vector<TokenCounts> vcounts;
  size_t nverify = 0;
  for (size_t i = 0; i < b.verify_rows.size(); ++i) nverify += b.verify_rows[i].size();
  vcounts.reserve(nverify);  // pointers into it stay valid
  std::vector<size_t> verify_first(b.samples.size(), 0);
  for (size_t i = 0; i < b.samples.size(); ++i) {
    const SampleSpec& s = *b.samples[i];
    samples.push_back({b.sample_rows[i], s.params, s.index, s.counts, s.forced});
  }
  for (size_t i = 0; i < b.samples.size(); ++i) {
    const SampleSpec& s = *b.samples[i];
    verify_first[i] = samples.size();
    if (i >= b.verify_rows.size() || b.verify_rows[i].empty()) continue;
    const ChunkRef& ch = chunks[size_t(b.sample_inputs[i])];
    const int v = int(b.verify_rows[i].size());
    const int32_t* drafts = ch.tokens + ch.n - v;
    for (int j = 1; j <= v; ++j) {
      const TokenCounts* counts = nullptr;
      if (s.counts) {
        vcounts.push_back(verify_counts(s.counts, drafts, j));
        counts = &vcounts.back();
      }
      samples.push_back(
          {b.verify_rows[i][size_t(j - 1)], s.params, s.index + j, counts, verify_forced(s, j)});
    }
  }
  std::vector<cuda::DeviceSampler::Score> scores;
  for (const StepBatch::Score& sc : b.scores)
    for (size_t j = 0; j < sc.rows.size(); ++j)
      if (sc.rows[j] >= 0) scores.push_back({sc.rows[j], (*sc.ids)[j], sc.top});
  sampler_.stage(int(b.rows.size()), samples, scores);

  // A verify may be rejected: what its positions overwrite is saved first (device copies,
  // queued here and copied at the start of the step's pass: inside its graph, padded to the
  // segments the shape may need at most).
  std::vector<int> saved(chunks.size(), -1);
  size_t saves = 0;
  if (spec_) {
    spec_->rollback.reset();
    spec_->ints_used = 0;
    for (size_t i = 0; i < b.samples.size(); ++i)
      if (i < b.verify_rows.size() && !b.verify_rows[i].empty()) {
        const ChunkRef& ch = chunks[size_t(b.sample_inputs[i])];
        saved[size_t(b.sample_inputs[i])] =
            spec_->rollback.save(cache_, *ch.cache, CacheSpan{0, L, ch.start, ch.n});
        saves += size_t(rollback_span_bound(config(), 0, L, ch.n).segments);
      }
    if (saves) spec_->rollback.pad_saves(saves);
  }

  // With speculation, steps of verify shape are graphs too (the class comment).
  main_hidden_ = run_pass(Pass::kTarget, meta_, chunks, b.rows, spec_ != nullptr, nullptr, saves);
  // The wanted logits rows (the first num_logit_rows) before the sampler patches rows in place,
  // then the samples, scores and non-finite flags.
  const int V = config().vocab_size;
  const size_t n = size_t(b.num_logit_rows) * size_t(V);
  // Slices of whole rows (at least 1 MiB each): slice i is copied to the returned vector while
  // slice i + 1 downloads.
  const size_t rows = size_t(b.num_logit_rows);
  const size_t min_rows = std::max<size_t>(1, (size_t(1) << 18) / size_t(V));
  const size_t slice_rows = std::max(min_rows, (rows + kLogitSlices - 1) / size_t(kLogitSlices));
  const int slices = int((rows + slice_rows - 1) / slice_rows);
  for (int i = 0; i < slices; ++i) {
    const size_t r0 = size_t(i) * slice_rows, nr = std::min(slice_rows, rows - r0);
    DSV4_CUDA_CHECK(cudaMemcpyAsync(host_logits_ + r0 * V, model_.logits() + r0 * V,
                                    nr * V * sizeof(float), cudaMemcpyDeviceToHost, stream));
    DSV4_CUDA_CHECK(cudaEventRecord(slice_done_[i], stream));
  }
  sampler_.launch(model_.logits(), stream);
  StepOutput out;
  if (n) {
    out.logits = std::move(spare_logits_);
    spare_logits_ = {};
    out.logits.clear();
    out.logits.reserve(n);  // no zero fill: the slices are appended
    for (int i = 0; i < slices; ++i) {
      const size_t r0 = size_t(i) * slice_rows, nr = std::min(slice_rows, rows - r0);
      DSV4_CUDA_CHECK(cudaEventSynchronize(slice_done_[i]));
      out.logits.insert(out.logits.end(), host_logits_ + r0 * V, host_logits_ + (r0 + nr) * V);
    }
  }
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));

  // As sample_on_host: per input, the first non-finite row (in row order) names the error; a
  // failed input's samples and scores are id -1.
  out.errors.resize(b.chunks.size());
  std::vector<int> row0(b.chunks.size(), 0);
  for (size_t i = 1; i < b.chunks.size(); ++i) row0[i] = row0[i - 1] + b.chunks[i - 1].n;
  for (size_t i = 0; i < b.rows.size(); ++i) {
    const int in = b.row_input[i];
    std::string& e = out.errors[size_t(in)];
    const int v = sampler_.nonfinite_index(int(i));
    if (!e.empty() || v < 0) continue;
    e = nonfinite_logits_error(b.chunks[size_t(in)].start + (b.rows[i] - row0[size_t(in)]), v,
                               sampler_.nonfinite_value(int(i)));
  }
  auto failed = [&](int row_index) {
    return !out.errors[size_t(b.row_input[size_t(row_index)])].empty();
  };
  out.samples.resize(b.samples.size());
  out.more.resize(b.samples.size());
  out.drafts.resize(b.samples.size());
  for (size_t i = 0; i < b.samples.size(); ++i) {
    if (failed(b.sample_rows[i])) continue;
    out.samples[i] = sampler_.sample(int(i));
    if (i >= b.verify_rows.size() || b.verify_rows[i].empty()) continue;
    const ChunkRef& ch = chunks[size_t(b.sample_inputs[i])];
    const int v = int(b.verify_rows[i].size());
    std::vector<SampledToken> rows;
    for (int j = 0; j < v; ++j) rows.push_back(sampler_.sample(int(verify_first[i]) + j));
    out.more[i] = accepted_chain(out.samples[i], rows, ch.tokens + ch.n - v);
  }
  int k = 0;
  for (const StepBatch::Score& sc : b.scores) {
    std::vector<SampledToken> row(sc.rows.size());
    for (size_t j = 0; j < sc.rows.size(); ++j) {
      if (sc.rows[j] < 0) continue;
      if (!failed(sc.rows[j])) row[j] = sampler_.score(k);
      ++k;
    }
    out.scores.push_back(std::move(row));
  }
  if (!spec_) return out;

  // Rollback of rejected drafts (Rollback, model/runner.h). kRerun: every store the step wrote
  // goes back to before it and the kept tokens run again as one chunk; the MTP block takes the
  // kept tokens' streams from the pass that left the cache (the target forward, or the rerun).
  // kRestore: only the stores the rejected positions changed go back; the kept tokens' stores
  // and streams are the target forward's.
  const std::vector<int> kept = kept_tokens(b, out);
  const std::vector<MtpRun> runs = mtp_runs(b, kept, out.errors);
  std::vector<bool> rerun(chunks.size(), false);
  std::vector<CacheRollback::Rejected> rejected;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (saved[i] < 0 || kept[i] == chunks[i].n) continue;
    if (rollback_ == Rollback::kRerun)
      rerun[i] = true;
    else
      rejected.push_back(
          {saved[i], chunks[i].cache, CacheSpan{0, L, chunks[i].start, chunks[i].n}, kept[i]});
  }
  if (!rejected.empty()) spec_->rollback.restore_rejected(cache_, rejected, stream);
  auto ok = [&](size_t i) { return out.errors[i].empty(); };
  std::vector<size_t> which, states;
  for (size_t r = 0; r < runs.size(); ++r)
    if (!rerun[runs[r].chunk]) which.push_back(r);
  for (size_t i = 0; i < chunks.size(); ++i)
    if (ok(i) && !rerun[i]) states.push_back(i);
  move_mtp_rows(b, kept, runs, which, states, row0, main_hidden_);
  std::vector<ChunkRef> again;
  std::vector<int> handles, again_row0(chunks.size(), 0);
  which.clear(), states.clear();
  int row = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (!rerun[i]) continue;
    handles.push_back(saved[i]);
    again.push_back({chunks[i].cache, chunks[i].start, chunks[i].tokens, kept[i]});
    again_row0[i] = row;
    row += kept[i];
    if (ok(i)) states.push_back(i);
  }
  if (!again.empty()) {
    spec_->rollback.restore(handles, stream);
    const __nv_bfloat16* streams = run_pass(Pass::kTarget, meta_, again, {0}, true);
    for (size_t r = 0; r < runs.size(); ++r)
      if (rerun[runs[r].chunk]) which.push_back(r);
    move_mtp_rows(b, kept, runs, which, states, again_row0, streams);
  }
  mtp_after_step(b, kept, runs, out);
  // The speculation's staged ids and segment lists are reused by the next step.
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

void CudaRunner::move_mtp_rows(const StepBatch& b, const std::vector<int>& kept,
                               const std::vector<MtpRun>& runs, const std::vector<size_t>& which,
                               const std::vector<size_t>& chunks, const std::vector<int>& row0,
                               const __nv_bfloat16* streams) {
  const int64_t width = int64_t(config().hc_mult) * config().dim;
  // Every run's rows sit at its offset in the spec buffer (runs in order).
  std::vector<int64_t> offset(runs.size() + 1, 0);
  for (size_t r = 0; r < runs.size(); ++r) offset[r + 1] = offset[r] + runs[r].n();
  std::vector<int32_t> src, dst;
  for (size_t r : which) {
    const MtpRun& run = runs[r];
    const int64_t start = b.chunks[run.chunk].start;
    for (int64_t p = run.first; p < run.end; ++p) {
      src.push_back(p < start ? -run.seq->state_slot - 1 : int32_t(row0[run.chunk] + (p - start)));
      dst.push_back(int32_t(offset[r] + (p - run.first)));
    }
  }
  const cudaStream_t stream = model_.stream();
  __nv_bfloat16* pool = cache_.mtp_hidden_pool();
  if (!src.empty()) {
    const int32_t* d_src = upload_ints(src);
    const int32_t* d_dst = upload_ints(dst);
    glue::move_rows(streams, pool, width, d_src, d_dst, int(src.size()), spec_->rows.data(),
                    stream);
  }
  // The states after the rows above read them: streams of each sequence's last kept row.
  src.clear(), dst.clear();
  for (size_t i : chunks) {
    src.push_back(row0[i] + kept[i] - 1);
    dst.push_back(b.chunks[i].cache->state_slot);
  }
  if (!src.empty()) {
    const int32_t* d_src = upload_ints(src);
    const int32_t* d_dst = upload_ints(dst);
    glue::move_rows(streams, pool, width, d_src, d_dst, int(src.size()), pool, stream);
  }
}

// The MTP block (model/speculation.h): its run over the positions the step made known, then
// the drafts, chained, batched over the sequences that want them.
void CudaRunner::mtp_after_step(const StepBatch& b, const std::vector<int>& kept,
                                const std::vector<MtpRun>& runs, StepOutput& out) {
  const ModelConfig& c = config();
  const int L = c.n_layers;
  const int64_t width = int64_t(c.hc_mult) * c.dim;
  const cudaStream_t stream = model_.stream();
  Spec& sp = *spec_;
  if (!runs.empty()) {
    std::vector<ChunkRef> cs;
    for (const MtpRun& r : runs) cs.push_back(r.chunk_ref());
    // No head (Pass::kMtpRun): the runs' logits are not used.
    run_pass(Pass::kMtpRun, sp.meta[0], cs, {0}, true, sp.rows.data());
  }
  finish_mtp(b, kept, out.errors);

  std::vector<DraftSeed> ds = draft_seeds(b, kept, out);
  if (ds.empty()) return;
  // The drafts' ring slots are put back afterwards (their positions run again once verified).
  std::vector<int> handles;
  int most = 0;
  for (const DraftSeed& d : ds) {
    handles.push_back(sp.rollback.save(cache_, *d.seq, CacheSpan{L, L + 1, d.pos, d.count}));
    most = std::max(most, d.count);
  }
  sp.rollback.flush(stream);
  // Draft 1's streams: the sequences' MTP states.
  std::vector<int32_t> src;
  for (const DraftSeed& d : ds) src.push_back(-d.seq->state_slot - 1);
  glue::move_rows(main_hidden_, cache_.mtp_hidden_pool(), width, upload_ints(src), nullptr,
                  int(src.size()), sp.draft.data(), stream);
  std::vector<size_t> who;
  for (size_t k = 0; k < ds.size(); ++k) who.push_back(k);
  const __nv_bfloat16* drafted = nullptr;  // the previous draft step's output streams
  for (int j = 0; j < most; ++j) {
    if (j > 0) {
      // The drafting sequences' previous MTP output streams, in order.
      std::vector<size_t> next;
      src.clear();
      for (size_t r = 0; r < who.size(); ++r)
        if (ds[who[r]].count > j) next.push_back(who[r]), src.push_back(int32_t(r));
      who = std::move(next);
      glue::move_rows(drafted, cache_.mtp_hidden_pool(), width, upload_ints(src), nullptr,
                      int(src.size()), sp.draft.data(), stream);
    }
    std::vector<ChunkRef> dc;
    std::vector<int> rows;
    std::vector<cuda::DeviceSampler::Sample> greedy;
    for (size_t r = 0; r < who.size(); ++r) {
      DraftSeed& d = ds[who[r]];
      dc.push_back({d.seq, d.pos, &d.token, 1});
      rows.push_back(int(r));
      greedy.push_back({int(r), &sp.greedy, 0, nullptr, -1});
    }
    drafted = run_pass(Pass::kMtpDraft, sp.meta[1], dc, rows, true, sp.draft.data());
    sampler_.stage(int(rows.size()), greedy, {});
    sampler_.launch(model_.logits(), stream);
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (size_t r = 0; r < who.size(); ++r) {
      DraftSeed& d = ds[who[r]];
      const int32_t best = chosen_draft(*b.samples[d.sample], d.index, sampler_.sample(int(r)).id);
      out.drafts[d.sample].push_back(best);
      d.token = best;
      ++d.pos;
      ++d.index;
    }
  }
  sp.rollback.restore(handles, stream);
}

}  // namespace dsv4
