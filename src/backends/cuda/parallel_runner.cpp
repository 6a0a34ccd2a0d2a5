#include "backends/cuda/parallel_runner.h"

#include <algorithm>
#include <string>

#include "backends/cpu/weights.h"
#include "backends/cuda/weights.h"
#include "comm/inproc_device_communicator.h"
#include "comm/rendezvous.h"
#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/device.h"
#ifdef DSV4_HAVE_NCCL
#include "comm/nccl_communicator.h"
#endif

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

PagedRunner::Limits runner_limits(const CudaModelLimits& m, const CacheConfig& c) {
  PagedRunner::Limits l;
  l.max_step_tokens = m.max_tokens;
  l.max_step_seqs = std::min(m.max_seqs, c.max_seqs);
  l.max_context = m.max_context;
  l.max_logit_rows = m.max_logit_rows > 0 ? std::min(m.max_logit_rows, m.max_tokens) : m.max_tokens;
  return l;
}

}  // namespace

ParallelCudaRunner::ParallelCudaRunner(const ModelConfig& config, const WeightsRef& weights,
                                       const ParallelConfig& parallel, const CacheConfig& cache,
                                       const CudaModelLimits& limits,
                                       const ParallelCudaOptions& options,
                                       const NodePlacement& node)
    : ParallelRunnerBase(config, cache, runner_limits(limits, cache), parallel, node),
      opt_(options),
      ranks_(size_t(local_ranks())) {
  const int W = layout().world(), local = local_ranks();
  const int gpus = cuda::device_count();
  DSV4_CHECK(gpus > 0, "backend 'cuda': no usable CUDA GPU (", cuda::describe_device(), ")");
  std::vector<uint8_t> nccl_id;
  if (opt_.comm == CudaCommKind::kInProcess) {
    DSV4_CHECK(nnodes() == 1,
               "--comm inproc runs every rank in one process; several nodes need --comm nccl");
    DSV4_CHECK(opt_.device >= 0 && opt_.device < gpus, "GPU ", opt_.device, " of ", gpus);
    devices_.assign(size_t(W), opt_.device);
    std::vector<std::unique_ptr<DeviceCommunicator>> world = make_inproc_device_communicators(W);
    for (int w = 0; w < W; ++w) ranks_[size_t(w)].world = std::move(world[size_t(w)]);
  } else {
#ifdef DSV4_HAVE_NCCL
    DSV4_CHECK(gpus >= local, "backend 'cuda': ", layout().describe(), " needs ", local,
               " GPUs over NCCL on this node (one per rank), this machine shows ", gpus,
               " (the in-process communicator runs every rank on one GPU, for tests)");
    for (int l = 0; l < local; ++l) devices_.push_back(l);
    // Node 0 makes the id; the others get it through the rendezvous.
    if (node.node_rank == 0) nccl_id = NcclCommunicator::unique_id();
    if (nnodes() > 1) nccl_id = rendezvous()->broadcast(nccl_id);
#else
    throw Error(
        "backend 'cuda': this build has no NCCL (python3 -m pip install nvidia-nccl-cu13, then "
        "reconfigure); the in-process communicator runs every rank on one GPU, for tests");
#endif
  }
  start_ranks([this](int l) { DSV4_CUDA_CHECK(cudaSetDevice(devices_[size_t(l)])); },
              [this](int l) {
                // The other ranks may be waiting for this one in a collective (in-process:
                // aborting the world ends its splits too; NCCL: each communicator is aborted
                // itself).
                // It may run on another rank's thread (RankPool): the pointers under comms_mu_.
                std::lock_guard<std::mutex> lock(comms_mu_);
                Rank& r = ranks_[size_t(l)];
                for (DeviceCommunicator* c : {r.ep.get(), r.group.get(), r.tp.get(), r.world.get()})
                  if (c) c->abort();
              });
  try {
    run_ranks([&](int l) {
      Rank& r = ranks_[size_t(l)];
      const int w = first_rank() + l;
      const ParallelLayout& L = layout();
      r.device = std::make_unique<DeviceContext>(devices_[size_t(l)]);
#ifdef DSV4_HAVE_NCCL
      if (!r.world) {
        auto world = std::make_unique<NcclCommunicator>(nccl_id, W, w, devices_[size_t(l)]);
        std::lock_guard<std::mutex> lock(comms_mu_);
        r.world = std::move(world);
      }
#endif
      auto keep = [&](std::unique_ptr<DeviceCommunicator>& slot,
                      std::unique_ptr<DeviceCommunicator> c) {
        std::lock_guard<std::mutex> lock(comms_mu_);
        slot = std::move(c);
      };
      keep(r.tp, r.world->split(w / L.config().tp, L.tp_rank(w)));
      keep(r.group, r.world->split(L.dp_group(w), w));
      keep(r.ep, r.world->split(L.ep_group(w), w));
      r.ctx = {&L, w, r.tp.get(), r.group.get(), r.ep.get()};
      CudaModelWeights mw = upload_cuda_weights(config, weights, false, shard_of(L, w));
      r.model = std::make_unique<CudaModel>(*r.device, config, std::move(mw), limits);
      r.model->set_rank(&r.ctx);
      r.cache = std::make_unique<DeviceCache>(r.model->config(), cache);
      r.meta = std::make_unique<StepBuffers>(step_limits(config, r.model->limits(), cache),
                                             config.window_size);
      if (w == group_leader(L.dp_group(w))) {
        const size_t n =
            size_t(r.model->limits().max_logit_rows) * size_t(config.vocab_size) * sizeof(float);
        DSV4_CUDA_CHECK(cudaMallocHost(&r.host_logits, n));
      }
      DSV4_CUDA_CHECK(cudaStreamSynchronize(r.device->stream()));
    });
  } catch (...) {
    shutdown();  // frees what the ranks made and joins their threads
    throw;
  }
}

ParallelCudaRunner::~ParallelCudaRunner() {
  shutdown();
}

void ParallelCudaRunner::shutdown() {
  // Each rank frees its device objects on its own thread (its device current), model before
  // context.
  try {
    run_ranks([&](int l) {
      Rank& r = ranks_[size_t(l)];
      if (r.device) cudaStreamSynchronize(r.device->stream());
      if (r.host_logits) cudaFreeHost(r.host_logits);
      r.host_logits = nullptr;
      r.meta.reset();
      r.cache.reset();
      r.model.reset();
      {
        std::lock_guard<std::mutex> lock(comms_mu_);
        r.ep.reset();
        r.group.reset();
        r.tp.reset();
        r.world.reset();
      }
      r.device.reset();
    });
  } catch (...) {
  }
  stop_ranks();
}

// Page and state copies go on each rank's own stream (ordered before its next forward).
void ParallelCudaRunner::rank_reset_states(int l, int slot) {
  Rank& r = ranks_[size_t(l)];
  r.device->make_current();
  r.cache->reset_states(slot, r.device->stream());
}

void ParallelCudaRunner::rank_copy_sequence(int l, const SequenceCache& from,
                                            const SequenceCache& to) {
  Rank& r = ranks_[size_t(l)];
  r.device->make_current();
  r.cache->copy_sequence(from, to, r.device->stream());
}

void ParallelCudaRunner::rank_copy_pages(int l, const std::vector<PageCopy>& copies) {
  Rank& r = ranks_[size_t(l)];
  r.device->make_current();
  for (const PageCopy& c : copies) r.cache->copy_page(c, r.device->stream());
}

void ParallelCudaRunner::local_forward(const std::vector<StepBatch>& batches,
                                       std::vector<GroupResult>& results) {
  const int V = config().vocab_size;
  run_ranks([&](int l) {
    Rank& r = ranks_[size_t(l)];
    const int w = first_rank() + l;
    const int g = layout().dp_group(w);
    const StepBatch& b = batches[size_t(g)];
    const cudaStream_t stream = r.device->stream();
    if (b.chunks.empty()) {
      // Every rank runs every block's MoE exchange (they span the world).
      r.model->idle_forward();
      DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
      return;
    }
    const DeviceStep st = r.meta->build(b.chunks, b.rows, -1, stream);
    r.model->forward(st, *r.cache);
    // The group's first rank alone downloads the logits (node 0 samples them).
    const bool leader = w == group_leader(g);
    const size_t n = leader ? b.rows.size() * size_t(V) : 0;
    if (n)
      DSV4_CUDA_CHECK(cudaMemcpyAsync(r.host_logits, r.model->logits(), n * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (leader) results[size_t(g)].logits.assign(r.host_logits, r.host_logits + n);
  });
}

}  // namespace dsv4
