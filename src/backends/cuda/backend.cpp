#include "backends/cuda/backend.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "backends/cpu/weights.h"
#include "backends/cuda/device_context.h"
#include "backends/cuda/model.h"
#include "backends/cuda/parallel_runner.h"
#include "backends/cuda/runner.h"
#include "backends/cuda/verify.h"
#include "backends/cuda/weights.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "model/cache_spec.h"
#include "model/memory_plan.h"
#include "model/model_source.h"
#include "model/speculation.h"
#include "model/weight_scan.h"
#include "model/weights.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/device.h"

namespace dsv4 {

namespace {

// What a rank's model is sized for: the options' sequences and context, the plan's step.
CudaModelLimits model_limits(const RunnerOptions& o, const MemoryPlan& plan) {
  CudaModelLimits lim;
  lim.max_seqs = o.max_sequences;
  lim.max_context = o.max_tokens;
  lim.exact_linears = o.exact_linears;
  lim.max_tokens = int(plan.step.tokens);
  lim.max_logit_rows = int(plan.step.logit_rows);
  return lim;
}

// Several ranks: the parallel engine (backends/cuda/parallel_runner.h).
std::unique_ptr<Runner> open_parallel_cuda_runner(const RunnerOptions& o) {
  DSV4_CHECK(o.parallel_comm == "nccl" || o.parallel_comm == "inproc", "unknown communicator '",
             o.parallel_comm, "' (nccl, inproc)");
  DSV4_CHECK(!o.verify, "verify mode runs one rank (dp ", o.dp, ", ep ", o.ep, ", tp ", o.tp,
             " asked)");
  const ModelHeader header = open_model_header(o.source());
  const ModelConfig& config = header.config;
  const QuantScheme& scheme = header.scheme;
  check_cuda_supported(config);
  ParallelConfig pc;
  pc.dp = o.dp;
  pc.ep = o.ep;
  pc.tp = o.tp;
  const ParallelLayout layout(config, pc);  // a tuple that does not divide: its error first
  ParallelCudaOptions po;
  po.comm = o.parallel_comm == "inproc" ? CudaCommKind::kInProcess : CudaCommKind::kNccl;
  po.cuda_graphs = o.cuda_graphs;  // decode steps (parallel_runner.h)
  // The memory plan first: one pool per rank; in-process every rank shares GPU 0.
  const MemoryPlan plan = plan_memory(config, scheme, memory_plan_options(o, PlanBackend::kCuda));
  if (po.comm == CudaCommKind::kInProcess) {
    DSV4_CUDA_CHECK(cudaSetDevice(po.device));
    MemoryPool all;
    all.name = cat("GPU ", po.device, " memory (", plan.pools.size(), " ranks in-process)");
    for (const MemoryPool& p : plan.pools) {
      all.weights += p.weights;
      all.cache += p.cache;
      all.cache_min += p.cache;
      all.activations += p.activations;
      all.reserve = std::max(all.reserve, p.reserve);
    }
    size_t free = 0, total = 0;
    DSV4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    require_fits(all, int64_t(free), "free on the GPU");
  } else {
    // This node's ranks, rank first + l on its GPU l.
    const int per = layout.world() / std::max(1, o.nnodes), first = o.node_rank * per;
    for (const MemoryPool& p : plan.pools) {
      const int gpu = p.rank - first;
      if (p.rank < first || p.rank >= first + per || gpu >= cuda::device_count())
        continue;  // another node's, or the runner says why
      DSV4_CUDA_CHECK(cudaSetDevice(gpu));
      size_t free = 0, total = 0;
      DSV4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
      MemoryPool q = p;
      q.cache_min = q.cache;  // the pool is not shrunk here
      require_fits(q, int64_t(free), cat("free on GPU ", gpu, " (rank ", p.rank, ")"));
    }
  }
  // Each group's pool: the flag's size, else room for max_sequences x max_tokens (not shrunk
  // to what is left: the ranks share or split the GPUs).
  const CacheConfig cc = plan_cache(config, o.max_sequences, o.max_tokens, o.page_size,
                                    o.cache_bytes, o.snapshot_slots);
  const CudaModelLimits lim = model_limits(o, plan);
  const std::unique_ptr<Checkpoint> ckpt = open_model_checkpoint(o.source());
  const WeightsRef ref = bind_weights(*ckpt, config, scheme);
  check_weights_finite(*ckpt);
  return std::make_unique<ParallelCudaRunner>(config, ref, pc, cc, lim, po,
                                              NodePlacement{o.nnodes, o.node_rank, o.rendezvous});
}

}  // namespace

std::unique_ptr<Runner> open_cuda_runner(const RunnerOptions& o) {
  DSV4_CHECK(o.page_size > 0 && o.page_size <= 4096, "page size must be in [1, 4096]");
  DSV4_CHECK(o.max_sequences > 0, "max_sequences must be positive");
  DSV4_CHECK(o.max_tokens > 0, "max_tokens must be positive");
  DSV4_CHECK(o.max_step_tokens >= 0 && o.cache_bytes >= 0, "negative step or cache size");
  o.source().check();
  DSV4_CHECK(cuda::device_count() > 0, "backend 'cuda': no usable CUDA GPU (",
             cuda::describe_device(), ")");
  if (o.dp != 1 || o.ep != 1 || o.tp != 1) return open_parallel_cuda_runner(o);
  DSV4_CHECK(o.nnodes == 1, "--nnodes ", o.nnodes,
             ": one rank cannot span nodes (give --dp/--ep/--tp a world of at least ", o.nnodes,
             " ranks)");
  auto owned = std::make_unique<CudaRunner::Owned>();
  const ModelHeader header = open_model_header(o.source());
  const ModelConfig& config = header.config;
  const QuantScheme& scheme = header.scheme;
  check_cuda_supported(config);
  owned->context = std::make_unique<DeviceContext>(0);
  // The memory plan first: refuse what cannot fit before uploading or allocating anything.
  const MemoryPlan plan = plan_memory(config, scheme, memory_plan_options(o, PlanBackend::kCuda));
  {
    size_t free = 0, total = 0;
    DSV4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    require_fits(plan.pools.at(0), int64_t(free), "free on the GPU");
    if (o.verify) require_fits(plan.pools.at(1), host_available_bytes(), "MemAvailable");
  }
  {
    const std::unique_ptr<Checkpoint> ckpt = open_model_checkpoint(o.source());
    const WeightsRef ref = bind_weights(*ckpt, config, scheme);
    check_weights_finite(*ckpt);
    size_t bytes = 0;
    for (const std::string& n : ckpt->names()) bytes += ckpt->get(n).nbytes;
    CudaModelWeights w = upload_cuda_weights(config, ref, bytes >= (size_t(1) << 30));
    if (o.verify) owned->cpu_weights = cpu::prepare_weights(config, ref);

    const CudaModelLimits lim = model_limits(o, plan);
    owned->model = std::make_unique<CudaModel>(*owned->context, config, std::move(w), lim);
  }

  // The cache pool: the flag's size, else room for max_sequences x max_tokens, shrunk to the
  // memory left when that does not fit.
  CacheConfig cc;
  if (o.cache_bytes > 0) {
    cc = plan_cache(config, o.max_sequences, o.max_tokens, o.page_size, o.cache_bytes,
                    o.snapshot_slots);
  } else {
    cc = plan_cache(config, o.max_sequences, o.max_tokens, o.page_size, 0, o.snapshot_slots);
    size_t free = 0, total = 0;
    DSV4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    // Speculation's buffers (allocated when the engine enables it) and the MTP state come out
    // of the same memory (the plan's pool counts them).
    const int64_t avail = int64_t(free) - kCudaReserveBytes - plan.pools.at(0).speculation -
                          device_mtp_state_bytes(config, cc.max_seqs + 1);
    if (cache_bytes(config, cc) > avail) {
      cc = plan_cache(config, o.max_sequences, o.max_tokens, o.page_size, avail, o.snapshot_slots);
      std::fprintf(stderr,
                   "dsv4: the GPU has room for a %lld MiB cache pool, less than %d sequences "
                   "of %lld tokens need; long sequences may find the cache full\n",
                   (long long)(avail >> 20), o.max_sequences, (long long)o.max_tokens);
    }
  }
  CudaRunnerOptions ro;
  ro.cuda_graphs = o.cuda_graphs;
  auto runner = std::make_unique<CudaRunner>(*owned->model, cc, ro);
  if (o.verify) {
    // The model's config, not this function's: the verifier keeps a reference.
    owned->verifier = std::make_unique<CudaVerifier>(owned->model->config(), owned->cpu_weights,
                                                     runner->cache(), owned->model->stream());
    owned->verifier->set_blocks(o.verify_first_layer, o.verify_last_layer);
    runner->set_verifier(owned->verifier.get());
  }
  runner->adopt(std::move(owned));
  return runner;
}

int64_t cuda_free_device_bytes(std::string* why) {
  if (cuda::device_count() == 0) {
    *why = cuda::describe_device();
    return -1;
  }
  DSV4_CUDA_CHECK(cudaSetDevice(0));
  size_t free = 0, total = 0;
  DSV4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return int64_t(free);
}

void register_cuda_backend() {
  register_backend("cuda", &open_cuda_runner);
}

}  // namespace dsv4
