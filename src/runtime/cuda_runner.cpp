#include "runtime/cuda_runner.h"

#include <algorithm>
#include <set>

#include "core/error.h"
#include "model/cuda_verify.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4 {
namespace {

StepLimits step_limits(const CudaModel& m, const CacheConfig& c) {
  const ModelConfig& mc = m.config();
  StepLimits l;
  l.max_tokens = m.limits().max_tokens;
  l.max_seqs = std::min(m.limits().max_seqs, c.max_seqs);
  auto pages = [&](int64_t entries) {
    return int(std::max<int64_t>(1, (entries + c.page_size - 1) / c.page_size));
  };
  const int64_t ctx = m.limits().max_context;
  l.stride[int(PageKind::kWindow)] = pages(mc.window_size);
  l.stride[int(PageKind::kC4)] = pages(ctx / 4);
  l.stride[int(PageKind::kC128)] = pages(ctx / 128);
  return l;
}

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

}  // namespace

CacheConfig plan_cache(const ModelConfig& c, int max_seqs, int64_t max_context, int page_size,
                       int64_t budget) {
  CacheConfig want = CacheConfig::for_capacity(c, max_seqs, max_context, page_size);
  if (budget <= 0) return want;
  CacheConfig fixed = want;
  fixed.pages[int(PageKind::kC4)] = fixed.pages[int(PageKind::kC128)] = 0;
  const int64_t base = DeviceCache::bytes_needed(c, fixed);
  DSV4_CHECK(base <= budget, "cache budget of ", budget, " bytes is below the ", base, " bytes (",
             (base + (1 << 20) - 1) >> 20, " MiB) that the window rings and compressor ",
             "states of ", max_seqs, " sequence(s) need");
  // Bytes per page of each kind over all blocks, and the tokens one page covers.
  CacheConfig one = fixed;
  one.pages[int(PageKind::kC4)] = 1;
  const int64_t c4_page = DeviceCache::bytes_needed(c, one) - base;
  one = fixed;
  one.pages[int(PageKind::kC128)] = 1;
  const int64_t c128_page = DeviceCache::bytes_needed(c, one) - base;
  const double per_token = (c4_page ? double(c4_page) / (4.0 * page_size) : 0.0) +
                           (c128_page ? double(c128_page) / (128.0 * page_size) : 0.0);
  // Allocation granularity (256 B per store) makes bytes_needed slightly super-additive: aim a
  // little below the budget and check.
  int64_t tokens = per_token > 0 ? int64_t(double(budget - base) * 0.99 / per_token) : 0;
  CacheConfig out = fixed;
  for (;;) {
    out.pages[int(PageKind::kC4)] = c4_page ? int(tokens / 4 / page_size) : 0;
    out.pages[int(PageKind::kC128)] = c128_page ? int(tokens / 128 / page_size) : 0;
    if (DeviceCache::bytes_needed(c, out) <= budget || tokens == 0) break;
    tokens = tokens * 95 / 100;
  }
  return out;
}

CudaRunner::CudaRunner(CudaModel& model, const CacheConfig& cache, const CudaRunnerOptions& o)
    : model_(model),
      blocks_(model.config(), cache),
      cache_(model.config(), cache),
      meta_(step_limits(model, cache), model.config().window_size),
      opt_(o) {}

CudaRunner::~CudaRunner() {
  for (auto& [key, g] : graphs_) {
    if (g.exec) cudaGraphExecDestroy(g.exec);
    if (g.graph) cudaGraphDestroy(g.graph);
  }
}

void CudaRunner::set_verifier(CudaVerifier* v) {
  verify_ = v;
  model_.set_verifier(v);
}

int CudaRunner::open_sequence() {
  SequenceCache s = blocks_.begin_sequence();
  cache_.reset_states(s.state_slot, model_.stream());
  const int id = next_id_++;
  seqs_.emplace(id, std::move(s));
  return id;
}

void CudaRunner::close_sequence(int seq) {
  auto it = seqs_.find(seq);
  DSV4_CHECK(it != seqs_.end(), "unknown sequence ", seq);
  blocks_.end_sequence(it->second);
  seqs_.erase(it);
}

SequenceCache& CudaRunner::sequence(int seq) {
  auto it = seqs_.find(seq);
  DSV4_CHECK(it != seqs_.end(), "unknown sequence ", seq);
  return it->second;
}

int64_t CudaRunner::length(int seq) const {
  auto it = seqs_.find(seq);
  DSV4_CHECK(it != seqs_.end(), "unknown sequence ", seq);
  return it->second.tokens;
}

std::vector<ChunkRef> CudaRunner::prepare(const std::vector<StepInput>& inputs,
                                          std::vector<int>* logit_rows) {
  const ModelConfig& c = model_.config();
  const StepLimits& lim = meta_.limits();
  DSV4_CHECK(!inputs.empty(), "empty step");
  DSV4_CHECK(int(inputs.size()) <= lim.max_seqs, "step of ", inputs.size(),
             " sequences exceeds the planned ", lim.max_seqs);
  std::set<int> seen;
  int64_t total = 0;
  for (const auto& in : inputs) {
    DSV4_CHECK(seen.insert(in.seq).second, "sequence ", in.seq, " appears twice in one step");
    SequenceCache& s = sequence(in.seq);
    DSV4_CHECK(!in.tokens.empty(), "empty token list for sequence ", in.seq);
    for (int32_t t : in.tokens)
      DSV4_CHECK(t >= 0 && t < c.vocab_size, "token id ", t, " out of range [0, ", c.vocab_size,
                 ")");
    const int64_t end = s.tokens + int64_t(in.tokens.size());
    DSV4_CHECK(end <= c.max_position_embeddings, "sequence would exceed max_position_embeddings (",
               c.max_position_embeddings, ")");
    DSV4_CHECK(end <= model_.limits().max_context, "sequence of ", end,
               " tokens exceeds the planned context of ", model_.limits().max_context);
    total += int64_t(in.tokens.size());
  }
  DSV4_CHECK(total <= lim.max_tokens, "step of ", total, " tokens exceeds the planned ",
             lim.max_tokens, " per step");
  // Every sequence's pages before any state changes (as CpuRunner).
  for (const auto& in : inputs) {
    SequenceCache& s = sequence(in.seq);
    blocks_.reserve(s, s.tokens + int64_t(in.tokens.size()));
  }
  std::vector<ChunkRef> chunks;
  int row = 0;
  for (const auto& in : inputs) {
    SequenceCache& s = sequence(in.seq);
    const int n = static_cast<int>(in.tokens.size());
    chunks.push_back({&s, s.tokens, in.tokens.data(), n});
    if (in.all_logits)
      for (int i = 0; i < n; ++i) logit_rows->push_back(row + i);
    else
      logit_rows->push_back(row + n - 1);
    row += n;
  }
  DSV4_CHECK(int(logit_rows->size()) <= model_.limits().max_logit_rows, "step wants ",
             logit_rows->size(), " logits rows, more than the planned ",
             model_.limits().max_logit_rows);
  return chunks;
}

// The end of the context bucket of a decode step: the next power of two >= 1024 of its
// largest position + 1, capped by the planned context.
int64_t CudaRunner::bucket(const std::vector<ChunkRef>& chunks) const {
  int64_t max_pos = 0;
  for (const ChunkRef& c : chunks) max_pos = std::max(max_pos, c.start + c.n - 1);
  return std::min(std::max<int64_t>(1024, next_pow2(max_pos + 1)), model_.limits().max_context);
}

void CudaRunner::run_graph(const std::vector<ChunkRef>& chunks, const std::vector<int>& rows) {
  const int64_t end = bucket(chunks);
  const cudaStream_t stream = model_.stream();
  const DeviceStep st = meta_.build(chunks, rows, end - 1, stream);
  const std::pair<int, int64_t> key{int(chunks.size()), end};
  if (auto it = graphs_.find(key); it != graphs_.end()) {
    DSV4_CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream));
    ++replays_;
    return;
  }
  if (seen_[key]++ == 0) {
    model_.forward(st, cache_);  // warm-up: kernels set their attributes outside the capture
    return;
  }
  Graph g;
  DSV4_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    model_.forward(st, cache_);
  } catch (const std::exception& e) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream, &broken);
    if (broken) cudaGraphDestroy(broken);
    cudaGetLastError();
    throw Error(
        cat("capturing the decode step of ", chunks.size(),
            " sequences as a CUDA graph failed (run without CUDA graphs to bypass): ", e.what()));
  }
  DSV4_CUDA_CHECK(cudaStreamEndCapture(stream, &g.graph));
  DSV4_CUDA_CHECK(cudaGraphInstantiate(&g.exec, g.graph, 0));
  graphs_[key] = g;
  DSV4_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
}

std::vector<float> CudaRunner::step(const std::vector<StepInput>& inputs) {
  std::vector<int> rows;
  std::vector<ChunkRef> chunks = prepare(inputs, &rows);
  bool decode = true;
  for (const ChunkRef& c : chunks) decode &= c.n == 1;
  const cudaStream_t stream = model_.stream();
  if (opt_.cuda_graphs && !verify_ && decode && opt_.graph_batch_sizes.count(int(chunks.size()))) {
    run_graph(chunks, rows);
  } else {
    const int64_t bound = decode && opt_.bucket_eager_decode ? bucket(chunks) - 1 : -1;
    const DeviceStep st = meta_.build(chunks, rows, bound, stream);
    model_.forward(st, cache_);
  }
  const int V = model_.config().vocab_size;
  std::vector<float> logits(rows.size() * size_t(V));
  DSV4_CUDA_CHECK(cudaMemcpyAsync(logits.data(), model_.logits(), logits.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (const auto& in : inputs) sequence(in.seq).tokens += int64_t(in.tokens.size());
  return logits;
}

}  // namespace dsv4
