#include "backends/cuda/parallel_runner.h"

#include <algorithm>
#include <string>

#include "backends/cpu/host_sampling.h"
#include "backends/cpu/weights.h"
#include "backends/cuda/weights.h"
#include "comm/first_failure.h"
#include "comm/inproc_device_communicator.h"
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

// As CudaRunner's (runner.cpp): the block-table rows of the planned context.
StepLimits step_limits(const ModelConfig& mc, const CudaModelLimits& m, const CacheConfig& c) {
  StepLimits l;
  l.max_tokens = m.max_tokens;
  l.max_seqs = std::min(m.max_seqs, c.max_seqs);
  auto pages = [&](int64_t entries) {
    return int(std::max<int64_t>(1, (entries + c.page_size - 1) / c.page_size));
  };
  l.stride[int(PageKind::kWindow)] = pages(mc.window_size);
  l.stride[int(PageKind::kC4)] = pages(m.max_context / 4);
  l.stride[int(PageKind::kC128)] = pages(m.max_context / 128);
  return l;
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
                                       const ParallelCudaOptions& options)
    : PagedRunner(config, cache, runner_limits(limits, cache), parallel.dp),
      layout_(config, parallel),
      opt_(options),
      ranks_(size_t(layout_.world())) {
  const int W = layout_.world();
  const int gpus = cuda::device_count();
  DSV4_CHECK(gpus > 0, "backend 'cuda': no usable CUDA GPU (", cuda::describe_device(), ")");
  std::vector<uint8_t> nccl_id;
  if (opt_.comm == CudaCommKind::kInProcess) {
    DSV4_CHECK(opt_.device >= 0 && opt_.device < gpus, "GPU ", opt_.device, " of ", gpus);
    devices_.assign(size_t(W), opt_.device);
    std::vector<std::unique_ptr<DeviceCommunicator>> world = make_inproc_device_communicators(W);
    for (int w = 0; w < W; ++w) ranks_[size_t(w)].world = std::move(world[size_t(w)]);
  } else {
#ifdef DSV4_HAVE_NCCL
    DSV4_CHECK(gpus >= W, "backend 'cuda': ", layout_.describe(), " needs ", W,
               " GPUs over NCCL (one per rank), this machine shows ", gpus,
               " (the in-process communicator runs every rank on one GPU, for tests)");
    for (int w = 0; w < W; ++w) devices_.push_back(w);
    nccl_id = NcclCommunicator::unique_id();
#else
    throw Error(
        "backend 'cuda': this build has no NCCL (python3 -m pip install nvidia-nccl-cu13, then "
        "reconfigure); the in-process communicator runs every rank on one GPU, for tests");
#endif
  }
  for (int w = 0; w < W; ++w) threads_.emplace_back([this, w] { worker(w); });
  try {
    run_all([&](int w) {
      Rank& r = ranks_[size_t(w)];
      r.device = std::make_unique<DeviceContext>(devices_[size_t(w)]);
#ifdef DSV4_HAVE_NCCL
      if (!r.world)
        r.world = std::make_unique<NcclCommunicator>(nccl_id, W, w, devices_[size_t(w)]);
#endif
      const int tp = layout_.config().tp;
      r.tp = r.world->split(w / tp, layout_.tp_rank(w));
      r.group = r.world->split(layout_.dp_group(w), w);
      r.ep = r.world->split(layout_.ep_group(w), w);
      r.ctx = {&layout_, w, r.tp.get(), r.group.get(), r.ep.get()};
      CudaModelWeights mw = upload_cuda_weights(config, weights, false, shard_of(layout_, w));
      r.model = std::make_unique<CudaModel>(*r.device, config, std::move(mw), limits);
      r.model->set_rank(&r.ctx);
      r.cache = std::make_unique<DeviceCache>(r.model->config(), cache);
      r.meta = std::make_unique<StepBuffers>(step_limits(config, r.model->limits(), cache),
                                             config.window_size);
      if (r.group->rank() == 0) {
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
  if (threads_.empty()) return;
  // Each rank frees its device objects on its own thread (its device current), model before
  // context.
  try {
    run_all([&](int w) {
      Rank& r = ranks_[size_t(w)];
      if (r.device) cudaStreamSynchronize(r.device->stream());
      if (r.host_logits) cudaFreeHost(r.host_logits);
      r.host_logits = nullptr;
      r.meta.reset();
      r.cache.reset();
      r.model.reset();
      r.ep.reset();
      r.group.reset();
      r.tp.reset();
      r.world.reset();
      r.device.reset();
    });
  } catch (...) {
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

void ParallelCudaRunner::worker(int w) {
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
      DSV4_CUDA_CHECK(cudaSetDevice(devices_[size_t(w)]));
      (*job)(w);
    } catch (...) {
      err = std::current_exception();
      // The other ranks may be waiting for this one in a collective (in-process: aborting
      // the world ends its splits too; NCCL: each communicator is aborted itself).
      Rank& r = ranks_[size_t(w)];
      for (DeviceCommunicator* c : {r.ep.get(), r.group.get(), r.tp.get(), r.world.get()})
        if (c) c->abort();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (err) errors_[size_t(w)] = err;
    if (--pending_ == 0) done_cv_.notify_all();
  }
}

void ParallelCudaRunner::run_all(const std::function<void(int)>& job) {
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

// Page and state copies go on each rank's own stream (ordered before its next forward).
void ParallelCudaRunner::reset_states(int g, int slot) {
  for (int w = 0; w < layout_.world(); ++w)
    if (layout_.dp_group(w) == g) {
      Rank& r = ranks_[size_t(w)];
      r.device->make_current();
      r.cache->reset_states(slot, r.device->stream());
    }
}

void ParallelCudaRunner::copy_sequence(int g, const SequenceCache& from, const SequenceCache& to) {
  for (int w = 0; w < layout_.world(); ++w)
    if (layout_.dp_group(w) == g) {
      Rank& r = ranks_[size_t(w)];
      r.device->make_current();
      r.cache->copy_sequence(from, to, r.device->stream());
    }
}

void ParallelCudaRunner::copy_pages(int g, const std::vector<PageCopy>& copies) {
  for (int w = 0; w < layout_.world(); ++w)
    if (layout_.dp_group(w) == g) {
      Rank& r = ranks_[size_t(w)];
      r.device->make_current();
      for (const PageCopy& c : copies) r.cache->copy_page(c, r.device->stream());
    }
}

StepOutput ParallelCudaRunner::forward(const StepBatch& batch) {
  std::vector<StepBatch> all(static_cast<size_t>(dp_size()));
  all[size_t(batch.dp_rank)] = batch;
  return std::move(forward_groups(all)[size_t(batch.dp_rank)]);
}

std::vector<StepOutput> ParallelCudaRunner::forward_groups(const std::vector<StepBatch>& batches) {
  const int V = config().vocab_size;
  std::vector<StepOutput> out(batches.size());
  run_all([&](int w) {
    Rank& r = ranks_[size_t(w)];
    const StepBatch& b = batches[size_t(layout_.dp_group(w))];
    const cudaStream_t stream = r.device->stream();
    if (b.chunks.empty()) {
      // Every rank runs every block's MoE exchange (they span the world).
      r.model->idle_forward();
      DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
      return;
    }
    const DeviceStep st = r.meta->build(b.chunks, b.rows, -1, stream);
    r.model->forward(st, *r.cache);
    // The group's first rank alone downloads the logits and samples.
    const bool leader = r.group->rank() == 0;
    const size_t n = leader ? b.rows.size() * size_t(V) : 0;
    if (n)
      DSV4_CUDA_CHECK(cudaMemcpyAsync(r.host_logits, r.model->logits(), n * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (!leader) return;
    StepOutput& o = out[size_t(layout_.dp_group(w))];
    o = sample_on_host(b, r.host_logits, V);
    o.logits.assign(r.host_logits, r.host_logits + size_t(b.num_logit_rows) * V);
  });
  return out;
}

}  // namespace dsv4
