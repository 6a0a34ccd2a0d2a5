#include "backends/cuda/runner.h"

#include <algorithm>
#include <set>

#include "backends/cpu/host_sampling.h"
#include "backends/cuda/verify.h"
#include "core/error.h"
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
      meta_(step_limits(model, cache), model.config().window_size),
      opt_(o),
      sampler_(model.config().vocab_size, model.limits().max_logit_rows,
               std::min(model.limits().max_seqs, cache.max_seqs)) {
  scratch_.state_slot = cache_.extra_slot(0);
  scratch_.pages[int(PageKind::kWindow)] = cache_.extra_window_pages(0);
  const size_t n = size_t(model.limits().max_logit_rows) * size_t(model.config().vocab_size);
  DSV4_CUDA_CHECK(cudaMallocHost(&host_logits_, n * sizeof(float)));
  for (cudaEvent_t& e : slice_done_)
    DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

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

void CudaRunner::set_verifier(CudaVerifier* v) {
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

int CudaRunner::graph_size(int n) const {
  const auto it = opt_.graph_batch_sizes.lower_bound(n);
  if (it == opt_.graph_batch_sizes.end()) return 0;
  if (*it == n) return n;
  const CudaModelLimits& l = model_.limits();
  const bool fits = *it <= limits().max_step_seqs && *it <= l.max_tokens &&
                    *it <= (l.max_logit_rows > 0 ? l.max_logit_rows : l.max_tokens);
  return opt_.pad_to_graph_sizes && fits ? *it : 0;
}

StepOutput CudaRunner::forward(const StepBatch& b) {
  const std::vector<ChunkRef>& chunks = b.chunks;
  const cudaStream_t stream = model_.stream();
  // The sampling requests are validated and staged before the forward pass runs.
  std::vector<cuda::DeviceSampler::Sample> samples;
  for (size_t i = 0; i < b.samples.size(); ++i) {
    const SampleSpec& s = *b.samples[i];
    samples.push_back({b.sample_rows[i], s.params, s.index, s.counts, s.forced});
  }
  std::vector<cuda::DeviceSampler::Score> scores;
  for (const StepBatch::Score& sc : b.scores)
    for (size_t j = 0; j < sc.rows.size(); ++j)
      if (sc.rows[j] >= 0) scores.push_back({sc.rows[j], (*sc.ids)[j], sc.top});
  sampler_.stage(int(b.rows.size()), samples, scores);

  const int padded = b.decode_only ? graph_size(int(chunks.size())) : 0;
  if (opt_.cuda_graphs && !verify_ && padded == int(chunks.size())) {
    run_graph(chunks, b.rows);
  } else if (opt_.cuda_graphs && !verify_ && padded > 0) {
    // Dummy rows after the real ones (token 0 at position 0 of the scratch sequence), each with
    // a logits row after the real rows: the graph's shapes, and the real rows come first.
    static const int32_t kToken = 0;
    std::vector<ChunkRef> all = chunks;
    std::vector<int> rows = b.rows;
    for (int i = int(chunks.size()); i < padded; ++i) {
      all.push_back({&scratch_, 0, &kToken, 1});
      rows.push_back(i);
    }
    run_graph(all, rows);
    ++padded_;
  } else {
    const int64_t bound = b.decode_only && opt_.bucket_eager_decode ? bucket(chunks) - 1 : -1;
    const DeviceStep st = meta_.build(chunks, b.rows, bound, stream);
    model_.forward(st, cache_);
  }
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
  for (size_t i = 0; i < b.samples.size(); ++i)
    if (!failed(b.sample_rows[i])) out.samples[i] = sampler_.sample(int(i));
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
  return out;
}

}  // namespace dsv4
