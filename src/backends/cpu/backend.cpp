#include "backends/cpu/backend.h"

#include "backends/cpu/loader.h"
#include "backends/cpu/parallel_runner.h"
#include "backends/cpu/runner.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "model/cache_spec.h"
#include "model/memory_plan.h"
#include "model/model_source.h"
#include "model/weight_scan.h"
#include "model/weights.h"

namespace dsv4 {

std::unique_ptr<Runner> open_cpu_runner(const RunnerOptions& o) {
  DSV4_CHECK(o.page_size > 0 && o.page_size <= 4096, "page size must be in [1, 4096]");
  DSV4_CHECK(o.max_sequences > 0, "max_sequences must be positive");
  DSV4_CHECK(o.max_tokens > 0, "max_tokens must be positive");
  DSV4_CHECK(o.cache_bytes >= 0, "negative cache size");
  DSV4_CHECK(!o.verify,
             "verify mode checks the CUDA backend against the CPU ops: it needs backend 'cuda'");
  const ModelHeader header = open_model_header(o.source());
  const ModelConfig& config = header.config;
  const QuantScheme& scheme = header.scheme;
  // The memory plan first: refuse what cannot fit before loading or allocating anything
  // (ranks as threads share this process: the plan sums their shards, caches and steps).
  const MemoryPlan plan = plan_memory(config, scheme, memory_plan_options(o, PlanBackend::kCpu));
  require_fits(plan.pools.at(0), host_available_bytes(), "MemAvailable");
  const ParallelConfig par{o.dp, o.ep, o.tp};
  DSV4_CHECK(o.nnodes == 1 || !par.single(), "--nnodes ", o.nnodes,
             ": one rank cannot span nodes (give --dp/--ep/--tp a world of at least ", o.nnodes,
             " ranks)");
  if (!par.single()) {
    const std::unique_ptr<Checkpoint> ckpt = open_model_checkpoint(o.source());
    check_weights_finite(*ckpt);
    const WeightsRef ref = bind_weights(*ckpt, config, scheme);
    const CacheConfig cc = plan_cache(config, o.max_sequences, o.max_tokens, o.page_size,
                                      o.cache_bytes, o.snapshot_slots);
    return std::make_unique<ParallelCpuRunner>(config, ref, par, cc,
                                               NodePlacement{o.nnodes, o.node_rank, o.rendezvous});
  }
  auto lm = std::make_unique<LoadedModel>(load_cpu_model(o.source()));
  const CacheConfig cc = plan_cache(lm->config, o.max_sequences, o.max_tokens, o.page_size,
                                    o.cache_bytes, o.snapshot_slots);
  auto r = std::make_unique<CpuRunner>(*lm->model, cc);
  r->adopt(std::move(lm));
  return r;
}

}  // namespace dsv4
