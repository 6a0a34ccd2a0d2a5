#include "backends/cpu/parallel_runner.h"

#include <algorithm>

#include "backends/cpu/host_sampling.h"
#include "backends/cpu/weights.h"
#include "comm/first_failure.h"
#include "comm/inproc_communicator.h"
#include "core/error.h"

namespace dsv4 {
namespace {

cpu::WeightShard shard_of(const ParallelLayout& L, int w) {
  cpu::WeightShard s;
  s.heads_lo = L.heads_lo(w);
  s.heads = L.heads_per_rank();
  s.groups_lo = L.groups_lo(w);
  s.groups = L.groups_per_rank();
  s.index_heads_lo = L.index_heads_lo(w);
  s.index_heads = L.index_heads_per_rank();
  s.experts_lo = L.experts_lo(w);
  s.experts = L.experts_per_rank();
  return s;
}

}  // namespace

ParallelCpuRunner::ParallelCpuRunner(const ModelConfig& config, const WeightsRef& weights,
                                     const ParallelConfig& parallel, const CacheConfig& cache)
    : PagedRunner(config, cache, Limits{}, parallel.dp),
      layout_(config, parallel),
      ranks_(size_t(layout_.world())) {
  const int W = layout_.world();
  std::vector<std::unique_ptr<Communicator>> world = make_inproc_communicators(W);
  for (int w = 0; w < W; ++w) ranks_[size_t(w)].world = std::move(world[size_t(w)]);
  for (int w = 0; w < W; ++w) threads_.emplace_back([this, w] { worker(w); });
  // Each rank: its groups (split is collective) and its shard of the weights, all at once.
  run_all([&](int w) {
    Rank& r = ranks_[size_t(w)];
    const int tp = layout_.config().tp;
    r.tp = r.world->split(w / tp, layout_.tp_rank(w));
    r.group = r.world->split(layout_.dp_group(w), w);
    r.ep = r.world->split(layout_.ep_group(w), w);
    r.ctx = {&layout_, w, r.world.get(), r.tp.get(), r.group.get(), r.ep.get()};
    r.model = std::make_unique<CpuModel>(
        config, cpu::prepare_weights(config, weights, shard_of(layout_, w)));
    r.model->set_rank(&r.ctx);
    r.cache = std::make_unique<HostCache>(r.model->config(), cache);
  });
}

ParallelCpuRunner::~ParallelCpuRunner() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ParallelCpuRunner::worker(int w) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || job_id_ != seen; });
      if (stop_) return;
      seen = job_id_;
      job = job_;
    }
    std::exception_ptr err;
    try {
      (*job)(w);
    } catch (...) {
      err = std::current_exception();
      // The other ranks may be waiting for this one in a collective.
      ranks_[size_t(w)].world->abort();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (err) errors_[size_t(w)] = err;
    if (--pending_ == 0) done_cv_.notify_all();
  }
}

void ParallelCpuRunner::run_all(const std::function<void(int)>& job) {
  std::unique_lock<std::mutex> lock(mu_);
  errors_.assign(ranks_.size(), nullptr);
  job_ = &job;
  pending_ = int(ranks_.size());
  ++job_id_;
  cv_.notify_all();
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  // The failure that caused the others (they report a collective aborted) comes first.
  if (std::exception_ptr first = first_failure(errors_)) std::rethrow_exception(first);
}

void ParallelCpuRunner::reset_states(int g, int slot) {
  for (int w = 0; w < layout_.world(); ++w)
    if (layout_.dp_group(w) == g) ranks_[size_t(w)].cache->reset_states(slot);
}

void ParallelCpuRunner::copy_sequence(int g, const SequenceCache& from, const SequenceCache& to) {
  for (int w = 0; w < layout_.world(); ++w)
    if (layout_.dp_group(w) == g) ranks_[size_t(w)].cache->copy_sequence(from, to);
}

void ParallelCpuRunner::copy_pages(int g, const std::vector<PageCopy>& copies) {
  for (int w = 0; w < layout_.world(); ++w)
    if (layout_.dp_group(w) == g)
      for (const PageCopy& c : copies) ranks_[size_t(w)].cache->copy_page(c);
}

StepOutput ParallelCpuRunner::forward(const StepBatch& batch) {
  std::vector<StepBatch> all(static_cast<size_t>(dp_size()));
  all[size_t(batch.dp_rank)] = batch;
  return std::move(forward_groups(all)[size_t(batch.dp_rank)]);
}

std::vector<StepOutput> ParallelCpuRunner::forward_groups(const std::vector<StepBatch>& batches) {
  const int V = config().vocab_size;
  std::vector<StepOutput> out(batches.size());
  run_all([&](int w) {
    Rank& r = ranks_[size_t(w)];
    const StepBatch& b = batches[size_t(layout_.dp_group(w))];
    // Every rank runs every block (the MoE exchanges span the world); the group's first rank
    // alone computes the logits and samples.
    const bool leader = r.group->rank() == 0;
    std::vector<int> bad;
    std::vector<float> logits =
        r.model->forward(b.chunks, *r.cache, leader ? b.rows : std::vector<int>{}, nullptr, nullptr,
                         leader ? &bad : nullptr);
    if (!leader || b.chunks.empty()) return;
    StepOutput& o = out[size_t(layout_.dp_group(w))];
    o = sample_on_host(b, logits.data(), V, nonfinite_errors(config(), b, bad));
    logits.resize(size_t(b.num_logit_rows) * V);
    o.logits = std::move(logits);
  });
  return out;
}

}  // namespace dsv4
