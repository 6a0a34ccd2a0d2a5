#include "backends/cpu/parallel_runner.h"

#include "backends/cpu/weights.h"
#include "comm/inproc_communicator.h"
#include "comm/tcp_communicator.h"
#include "core/error.h"

namespace dsv4 {
namespace {

// How long a rank waits in a collective for a silent peer on another node before failing.
constexpr double kCollectiveTimeoutS = 600;

}  // namespace

ParallelCpuRunner::ParallelCpuRunner(const ModelConfig& config, const WeightsRef& weights,
                                     const ParallelConfig& parallel, const CacheConfig& cache,
                                     const NodePlacement& node)
    : ParallelRunnerBase(config, cache, Limits{}, parallel, node), ranks_(size_t(local_ranks())) {
  const int W = layout().world();
  std::vector<std::unique_ptr<Communicator>> world =
      nnodes() > 1 ? make_tcp_communicators(*rendezvous(), W, kCollectiveTimeoutS)
                   : make_inproc_communicators(W);
  for (int l = 0; l < local_ranks(); ++l) ranks_[size_t(l)].world = std::move(world[size_t(l)]);
  // A failing rank aborts its world communicator (and so its splits): the ranks waiting for it
  // in a collective fail instead of waiting forever.
  start_ranks(nullptr, [this](int l) { ranks_[size_t(l)].world->abort(); });
  // Each rank: its groups (split is collective) and its shard of the weights, all at once.
  run_ranks([&](int l) {
    Rank& r = ranks_[size_t(l)];
    const int w = first_rank() + l;
    const ParallelLayout& L = layout();
    r.tp = r.world->split(w / L.config().tp, L.tp_rank(w));
    r.group = r.world->split(L.dp_group(w), w);
    r.ep = r.world->split(L.ep_group(w), w);
    r.ctx = {&L, w, r.world.get(), r.tp.get(), r.group.get(), r.ep.get()};
    r.model = std::make_unique<CpuModel>(
        config, cpu::prepare_weights(config, weights, cpu::shard_of(L, w)));
    r.model->set_rank(&r.ctx);
    r.cache = std::make_unique<HostCache>(r.model->config(), cache);
  });
}

ParallelCpuRunner::~ParallelCpuRunner() {
  stop_ranks();
}

void ParallelCpuRunner::rank_reset_states(int l, int slot) {
  ranks_[size_t(l)].cache->reset_states(slot);
}

void ParallelCpuRunner::rank_copy_sequence(int l, const SequenceCache& from,
                                           const SequenceCache& to) {
  ranks_[size_t(l)].cache->copy_sequence(from, to);
}

void ParallelCpuRunner::rank_copy_pages(int l, const std::vector<PageCopy>& copies) {
  for (const PageCopy& c : copies) ranks_[size_t(l)].cache->copy_page(c);
}

void ParallelCpuRunner::local_forward(const std::vector<StepBatch>& batches,
                                      std::vector<GroupResult>& results) {
  run_ranks([&](int l) {
    Rank& r = ranks_[size_t(l)];
    const int w = first_rank() + l;
    const int g = layout().dp_group(w);
    const StepBatch& b = batches[size_t(g)];
    // Every rank runs every block (the MoE exchanges span the world); the group's first rank
    // alone computes the logits.
    const bool leader = w == group_leader(g);
    std::vector<int> bad;
    std::vector<float> logits =
        r.model->forward(b.chunks, *r.cache, leader ? b.rows : std::vector<int>{}, nullptr, nullptr,
                         leader ? &bad : nullptr);
    if (!leader || b.chunks.empty()) return;
    logits.resize(b.rows.size() * size_t(config().vocab_size));
    results[size_t(g)] = {std::move(logits), std::move(bad)};
  });
}

}  // namespace dsv4
