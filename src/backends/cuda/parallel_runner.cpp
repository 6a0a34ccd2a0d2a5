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

// How long a node waits for the slowest to reach NCCL's setup (as the engine's start check,
// runtime/engine.cpp: loading a checkpoint of hundreds of GB may take minutes).
constexpr double kNodeStartWaitS = 1800;

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
    if (nnodes() > 1) {
      nccl_id = rendezvous()->broadcast(nccl_id);
      // Every node confirms it got here before any rank starts NCCL's set-up: a node that failed
      // before this point (its report reaches node 0 here as PeerFailed, and node 0's failure
      // reaches the others) is reported as such, not as a set-up that timed out. One that fails
      // after it: the set-up is non-blocking (NcclSetup), so the build's watch
      // (ParallelRunnerBase) cancels it here and the start check reports the cause; one that
      // stops answering: the set-up's deadline. Nodes may load at different speeds: the start
      // check's wait.
      rendezvous()->gather({}, kNodeStartWaitS);
      rendezvous()->broadcast({}, kNodeStartWaitS);
    }
#else
    throw Error(
        "backend 'cuda': this build has no NCCL (python3 -m pip install nvidia-nccl-cu13, then "
        "reconfigure); the in-process communicator runs every rank on one GPU, for tests");
#endif
  }
  start_ranks([this](int l) { DSV4_CUDA_CHECK(cudaSetDevice(devices_[size_t(l)])); },
              [this](int l) {
                // Ranks still in NCCL's set-up have no communicator to abort: they poll this.
                setup_cancelled_ = true;
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
        NcclSetup setup;
        setup.timeout_s = opt_.nccl_setup_timeout_s;
        setup.cancelled = [this] { return setup_cancelled_.load(); };
        auto world = std::make_unique<NcclCommunicator>(nccl_id, W, w, devices_[size_t(l)], setup);
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
      CudaModelWeights mw = upload_cuda_weights(config, weights, false, cpu::shard_of(L, w));
      r.model = std::make_unique<CudaModel>(*r.device, config, std::move(mw), limits);
      r.model->set_rank(&r.ctx);
      // One extra sequence: the graphs' padding rows.
      r.cache = std::make_unique<DeviceCache>(r.model->config(), cache, /*extra_seqs=*/1);
      r.scratch.state_slot = r.cache->extra_slot(0);
      r.scratch.pages[int(PageKind::kWindow)] = r.cache->extra_window_pages(0);
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
      destroy_graphs(r);
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

void ParallelCudaRunner::destroy_graphs(Rank& r) {
  for (auto& [key, g] : r.graphs) {
    if (g.exec) cudaGraphExecDestroy(g.exec);
    if (g.graph) cudaGraphDestroy(g.graph);
  }
  r.graphs.clear();
}

int ParallelCudaRunner::graph_size(int n) const {
  const auto it = opt_.graph_batch_sizes.lower_bound(n);
  if (it == opt_.graph_batch_sizes.end()) return 0;
  if (*it == n) return n;
  const Limits& l = limits();
  const bool fits = *it <= l.max_step_seqs && *it <= l.max_step_tokens && *it <= l.max_logit_rows;
  return opt_.pad_to_graph_sizes && fits ? *it : 0;
}

ParallelCudaRunner::StepPlan ParallelCudaRunner::plan_step(const std::vector<StepBatch>& batches) {
  StepPlan p;
  const size_t G = batches.size();
  p.rows.assign(G, 0);
  p.buckets.assign(G, 0);
  bool decode = false, all_decode = true;
  int most = 0;
  for (size_t g = 0; g < G; ++g) {
    const StepBatch& b = batches[g];
    if (b.chunks.empty()) continue;
    decode = true;
    all_decode = all_decode && b.decode_only;
    most = std::max(most, int(b.chunks.size()));
    p.rows[g] = int(b.chunks.size());
  }
  if (!decode || !all_decode) {
    for (size_t g = 0; g < G; ++g) p.rows[g] = 0;
    return p;  // eager, the host-sized exchange
  }
  const int64_t max_context = ranks_.at(0).model->limits().max_context;
  for (size_t g = 0; g < G; ++g)
    if (!batches[g].chunks.empty()) p.buckets[g] = decode_bucket(batches[g].chunks, max_context);
  const int padded_most = graph_size(most);
  p.decode_rows = padded_most > 0 ? padded_most : most;
  bool observed = false;
  for (const Rank& r : ranks_) observed = observed || r.model->observed();
  p.graphs = opt_.cuda_graphs && !observed;
  for (size_t g = 0; g < G && p.graphs; ++g)
    if (p.rows[g] > 0) p.graphs = graph_size(p.rows[g]) > 0;
  if (p.graphs)
    for (size_t g = 0; g < G; ++g)
      if (p.rows[g] > 0) p.rows[g] = graph_size(p.rows[g]);
  return p;
}

void ParallelCudaRunner::run_graph(int l, const GraphKey& key,
                                   const std::function<void()>& forward) {
  Rank& r = ranks_[size_t(l)];
  const cudaStream_t stream = r.device->stream();
  cudaGraphExec_t exec = nullptr;
  if (auto it = r.graphs.find(key); it != r.graphs.end()) {
    exec = it->second.exec;
    ++r.replays;
  } else {
    Graph g;
    DSV4_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      forward();
    } catch (const std::exception& e) {
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(stream, &broken);
      if (broken) cudaGraphDestroy(broken);
      cudaGetLastError();
      throw Error(cat("rank ", first_rank() + l, ": capturing the decode step of ",
                      std::get<0>(key), " rows (", std::get<1>(key),
                      " per group in the MoE exchange) as a CUDA graph failed (run without CUDA "
                      "graphs to bypass): ",
                      e.what()));
    }
    DSV4_CUDA_CHECK(cudaStreamEndCapture(stream, &g.graph));
    const cudaError_t made = cudaGraphInstantiate(&g.exec, g.graph, 0);
    if (made != cudaSuccess) {
      cudaGraphDestroy(g.graph);
      DSV4_CUDA_CHECK(made);
    }
    r.graphs[key] = g;
    exec = g.exec;
  }
  // Every rank's graph launched before any rank does other host work (launch_barrier()).
  r.world->launch_barrier();
  DSV4_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  r.world->launch_barrier();
}

// A collective replayed from a graph ran without the host: what its call could not report
// (the in-process communicator's size mismatch) fails the step here, once the stream completed.
void ParallelCudaRunner::check_collectives(Rank& r) {
  for (DeviceCommunicator* c : {r.tp.get(), r.group.get(), r.ep.get()})
    if (c) c->check_completed();
}

void ParallelCudaRunner::local_forward(const std::vector<StepBatch>& batches,
                                       std::vector<GroupResult>& results) {
  const int V = config().vocab_size;
  const StepPlan plan = plan_step(batches);
  // The world's shape: the first of each runs eagerly (with the graphs' shapes).
  bool graphs = plan.graphs;
  if (graphs) {
    std::vector<int64_t> shape{plan.decode_rows};
    for (size_t g = 0; g < batches.size(); ++g) {
      shape.push_back(plan.rows[g]);
      shape.push_back(plan.buckets[g]);
    }
    graphs = seen_[shape]++ > 0;
    if (graphs) ++graph_steps_;
    for (size_t g = 0; g < batches.size(); ++g)
      if (plan.rows[g] > int(batches[g].chunks.size())) {
        ++padded_steps_;
        break;
      }
  }
  run_ranks([&](int l) {
    Rank& r = ranks_[size_t(l)];
    const int w = first_rank() + l;
    const int g = layout().dp_group(w);
    const StepBatch& b = batches[size_t(g)];
    const cudaStream_t stream = r.device->stream();
    r.model->set_decode_rows(plan.decode_rows);
    if (b.chunks.empty()) {
      // Every rank runs every block's MoE exchange (they span the world).
      auto idle = [&] { r.model->idle_forward(); };
      if (graphs)
        run_graph(l, GraphKey{0, plan.decode_rows, 0}, idle);
      else
        idle();
      DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
      check_collectives(r);
      return;
    }
    // A graph step: the batch padded with dummy rows of the scratch sequence (token 0 at
    // position 0; their logits rows come after the real ones and are not downloaded), and
    // launches bounded by the context bucket's end.
    const int rows = plan.decode_rows > 0 && plan.graphs ? plan.rows[size_t(g)] : 0;
    std::vector<ChunkRef> chunks = b.chunks;
    std::vector<int> logit_rows = b.rows;
    static const int32_t kToken = 0;
    for (int i = int(chunks.size()); i < rows; ++i) {
      chunks.push_back({&r.scratch, 0, &kToken, 1});
      logit_rows.push_back(i);
    }
    const int64_t bound = plan.graphs || (plan.decode_rows > 0 && opt_.bucket_eager_decode)
                              ? plan.buckets[size_t(g)] - 1
                              : -1;
    const DeviceStep st = r.meta->build(chunks, logit_rows, bound, stream);
    auto forward = [&] { r.model->forward(st, *r.cache); };
    if (graphs)
      run_graph(l, GraphKey{rows, plan.decode_rows, plan.buckets[size_t(g)]}, forward);
    else
      forward();
    // The group's first rank alone downloads the logits (node 0 samples them).
    const bool leader = w == group_leader(g);
    const size_t n = leader ? b.rows.size() * size_t(V) : 0;
    if (n)
      DSV4_CUDA_CHECK(cudaMemcpyAsync(r.host_logits, r.model->logits(), n * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
    check_collectives(r);
    if (leader) results[size_t(g)].logits.assign(r.host_logits, r.host_logits + n);
  });
}

}  // namespace dsv4
