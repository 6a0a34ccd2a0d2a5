// The parallel engine's decode step and prefill (issue 13, point 2): the multi-rank twin of
// e2e_depth_bench. ParallelCudaRunner with (dp, ep, tp) over NCCL (rank w on GPU w) or the
// in-process communicator (every rank on GPU 0: a check on one GPU), V4-Flash or V4-Pro geometry
// (bench/cuda/depth_model.h: the real layer mix) at full depth (or --layers N) plus the MTP block's
// weights, routed experts in NVFP4 or MXFP4, CUDA graphs on as the serving path runs.
//
// Weights: random, in the checkpoint's formats, held on the host (host_weights(): the one place
// they come from); every rank uploads its shard as the engine does.
//
// Caches hold real data: per context length each dp group prefills one sequence of random tokens
// (chunks of 8192, the groups at once), then every sequence of the batch is a clone of its group's
// prototype (PagedRunner::clone_sequence: its own pages, so the batch reads B times the bytes). The
// world batch B is split over the dp groups as evenly as the engine's scheduler would (group g gets
// B / dp, the first B % dp one more).
//
// Decode: B sequences one token each through Runner::step (the serving step: greedy samples, the
// logits rows downloaded by each group's first rank and sampled on the host, as this engine does
// with several ranks), the first step of a shape eager, the second captured, then 2 warm-up and
// --iters timed replays: the median wall time per step. Tokens/s of the world (B / step) and per
// GPU (/ the GPUs: the world size over NCCL, 1 in-process). Prefill: 8192 tokens of one sequence on
// group 0 (the others idle), and one such sequence per dp group at once.
//
// Roofline beside each: rank 0's share of the step (its group's rows through the dense layers, the
// experts it owns for its expert group's rows, the head), bytes / 4.3 TB/s or FLOPs at the FP8 /
// BF16 rates, whichever is larger (depth_model.h's per-layer costs). The MTP block is loaded but
// not run (no speculative decoding here): it is not in the roofline either.
//
// Communication share: CUPTI (bench/cuda/kernel_trace.h) around two steps of each decode case — its
// first step (eager: the runner's first sight of the shape; its collectives also wait out the
// ranks' host launch skew) and one more after the timed ones (a replayed graph, as served) — and
// around one prefill step, split by rank (NCCL: the GPU; in-process: the launching thread, matched
// to the rank's stream where CUPTI's stream ids allow). Per rank: the time its GPU was busy (union
// of its kernels and copies), the time inside communication kernels (NCCL's, named nccl*: SendRecv
// = all-to-all, AllGather, AllReduce, ReduceScatter told apart by name; the in-process
// communicator's publish / gather / done kernels, one class: its all-gather and all-to-all share
// them), and the share. Neither communicator issues cudaMemcpy (read from the source): copies are
// listed apart, not counted; the MoE exchange's own pack / select / sum kernels (dsv4::exchange)
// too. A collective's time includes its wait for the slowest rank. At tp 1 every all-gather of a
// decode step is the MoE dispatch and every all-to-all its combine (parallel_moe.h); the host-sized
// exchange of prefill is all-gathers of counts + all-to-alls.
//
// Per rank / per world: every row says it ("per": "rank" or "world").
//
// Usage: parallel_step_bench [flash|pro] [nvfp4|mxfp4] [--dp N] [--ep N] [--tp N]
//        [--comm nccl|inproc] [--layers N] [--batches 1,32,128] [--contexts 4096,65536]
//        [--iters N] [--step-tokens N] [--no-prefill] [--no-trace] [--no-graphs] [--seed N]
//        [--dry-run] [--gpu-gib G]   (no GPU: the layout, bytes per GPU and the cases)
//        [--check-weights]           (no GPU: generates and binds the host weights, then stops)
// Output: JSON lines (stdout, and $DSV4_BENCH_OUT), progress on stderr.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cuda/parallel_runner.h"
#include "core/error.h"
#include "cuda/bench_util.h"
#include "cuda/depth_model.h"
#include "cuda/kernel_trace.h"
#include "io/checkpoint.h"
#include "model/cache_spec.h"
#include "model/memory_plan.h"
#include "model/parallel_layout.h"
#include "model/quant_scheme.h"
#include "model/tiny_checkpoint.h"
#include "model/weights.h"
#include "ops/common/sampling.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4 {
namespace {

using namespace depth;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
double gib(double bytes) {
  return bytes / double(1ull << 30);
}

constexpr int kPrefillTokens = 8192;
constexpr int kPageSize = 64;
// Tokens past the context each sequence may still take: the decode steps of a case.
constexpr int kTailTokens = 256;
// Device memory kept free beside the plan: CUDA graphs, NCCL's buffers, CUPTI.
constexpr double kSlackBytes = double(2ull << 30);

struct Options {
  std::string model = "flash", fmt = "nvfp4", comm = "nccl";
  int dp = 2, ep = 2, tp = 1;
  int layers = 0;  // 0: full depth
  std::vector<int> batches = {1, 32, 128};
  std::vector<int64_t> contexts = {4096, 65536};
  int iters = 20;
  // Tokens per group per step (the prototypes' and the prefill's chunks; the activations are
  // sized for it): less than the prefill's 8192 for a model that does not fit otherwise.
  int step_tokens = 8192;
  uint64_t seed = 1;
  bool prefill = true, trace = true, graphs = true, dry_run = false;
  bool check_weights = false;  // no GPU: generate and bind the host weights, then stop
  double gpu_gib = 139;        // --dry-run: memory per GPU (an H200 shows about 139 GiB free)
};

// ---- weights ----------------------------------------------------------------------------------

// The random weights on the host that every rank uploads its shard of (the one place they
// come from): the random-checkpoint generator (model/tiny_checkpoint.h) at the real shapes, in
// memory, every routed expert of a block an alias of the first one's bytes (held once: V4-Flash
// at full depth holds ~12 GB on the host and nothing on disk). Each rank uploads its experts
// as distinct device copies, so the bytes each expert GEMM reads are the real model's.
struct HostWeights {
  ModelConfig config;  // as the generated checkpoint declares it (what the ranks load)
  std::unique_ptr<Checkpoint> ckpt;
  WeightsRef ref;
  std::string what;
};

QuantScheme config_scheme(const ModelConfig& c) {
  return QuantScheme::of_config(c);
}

std::unique_ptr<HostWeights> host_weights(const std::string& preset, const ModelConfig& c,
                                          ExpertFormat fmt, uint64_t seed) {
  auto w = std::make_unique<HostWeights>();
  TinyInit init = tiny_init(preset);
  init.repeat_experts = true;
  TinyModel tm = make_tiny_model(c, fmt, seed, init);
  const ModelConfig& g = tm.config;
  DSV4_CHECK(g.n_layers == c.n_layers && g.n_mtp_layers == c.n_mtp_layers && g.dim == c.dim &&
                 g.n_routed_experts == c.n_routed_experts && g.vocab_size == c.vocab_size &&
                 g.compress_ratios == c.compress_ratios && g.n_hash_layers == c.n_hash_layers,
             "random weights: the generated checkpoint's geometry differs from the benchmark's");
  w->config = g;
  const std::string name = cat("random weights (", preset, ", ", expert_format_name(fmt), ", seed ",
                               seed, ", experts repeated)");
  const double held = double(tm.tensors->owned_bytes()), viewed = double(tm.tensors->view_bytes());
  w->ckpt = std::make_unique<Checkpoint>(name, tm.tensors);
  w->ref = bind_weights(*w->ckpt, g, tm.scheme);
  w->what = cat(name, ": ", gib(held), " GiB held on the host, ", gib(viewed), " GiB viewed");
  return w;
}

// ---- the plan -----------------------------------------------------------------------------------

// The world batch B over the dp groups, as evenly as the scheduler would.
std::vector<int> group_batches(int B, int dp) {
  std::vector<int> v(size_t(dp), B / dp);
  for (int g = 0; g < B % dp; ++g) ++v[size_t(g)];
  return v;
}

struct Case {
  int batch = 0;
  int64_t ctx = 0;
  std::vector<int> groups;  // per dp group
  CacheConfig pool;         // what the case needs (the prototypes included)
  double gpu_bytes = 0;     // the fullest GPU's need with this pool
  bool fits = false;
};

CacheConfig pool_max(const CacheConfig& a, const CacheConfig& b) {
  CacheConfig m = a;
  m.max_seqs = std::max(a.max_seqs, b.max_seqs);
  for (int k = 0; k < kNumPageKinds; ++k) m.pages[k] = std::max(a.pages[k], b.pages[k]);
  return m;
}

struct Plan {
  ModelConfig config;
  ParallelConfig parallel;
  std::string layout;
  int world = 0, ranks_per_gpu = 1, gpus = 0;
  std::vector<MemoryPool> ranks;  // per rank: weights, activations, reserve (cache: ours)
  std::vector<Case> cases;
  CacheConfig pool;  // every case that fits (and the prefill)
  int max_group_batch = 0;
  double available = 0;  // bytes per GPU
  // The fullest GPU's bytes with `pool` (null: without a cache): its ranks' weights,
  // activations, reserve and cache, and the slack.
  double gpu_bytes(const CacheConfig* p) const {
    double worst = 0;
    for (int gpu = 0; gpu < gpus; ++gpu) {
      double t = kSlackBytes;
      for (int w = gpu * ranks_per_gpu; w < (gpu + 1) * ranks_per_gpu; ++w) {
        const MemoryPool& r = ranks[size_t(w)];
        t += double(r.weights + r.activations + r.reserve);
        if (p) t += double(cache_bytes(config, *p));
      }
      worst = std::max(worst, t);
    }
    return worst;
  }
  double gpu_bytes(const CacheConfig& p) const { return gpu_bytes(&p); }
  bool base_fits() const { return gpu_bytes(nullptr) <= available; }
};

Plan make_plan(const Options& o, const ModelConfig& c, double available) {
  Plan p;
  p.config = c;
  p.parallel = ParallelConfig{o.dp, o.ep, o.tp};
  const ParallelLayout layout(c, p.parallel);  // throws naming what does not divide
  p.layout = layout.describe();
  p.world = layout.world();
  p.ranks_per_gpu = o.comm == "inproc" ? p.world : 1;
  p.gpus = p.world / p.ranks_per_gpu;
  p.available = available;
  const int64_t max_ctx = *std::max_element(o.contexts.begin(), o.contexts.end());
  for (int B : o.batches)
    p.max_group_batch = std::max(p.max_group_batch, group_batches(B, o.dp)[0]);
  MemoryPlanOptions mo;
  mo.backend = PlanBackend::kCuda;
  mo.max_sequences = p.max_group_batch + 1;
  mo.max_tokens = max_ctx + kTailTokens;
  mo.page_size = kPageSize;
  mo.max_step_tokens = o.step_tokens;
  mo.parallel = p.parallel;
  const MemoryPlan mp = plan_memory(c, config_scheme(c), mo);
  DSV4_CHECK(int(mp.pools.size()) == p.world, "memory plan: ", mp.pools.size(), " pools for ",
             p.world, " ranks");
  p.ranks = mp.pools;
  // The prefill: one sequence of kPrefillTokens per group.
  p.pool = cache_capacity(c, 1, kPrefillTokens + kTailTokens, kPageSize);
  for (int64_t ctx : o.contexts)
    for (int B : o.batches) {
      Case k;
      k.batch = B;
      k.ctx = ctx;
      k.groups = group_batches(B, o.dp);
      k.pool = cache_capacity(c, k.groups[0] + 1, ctx + kTailTokens, kPageSize);
      k.gpu_bytes = p.gpu_bytes(pool_max(p.pool, k.pool));
      k.fits = k.gpu_bytes <= available;
      p.cases.push_back(k);
    }
  // Every case that fits on its own shares one pool: drop the largest until they fit together.
  for (;;) {
    CacheConfig all = p.pool;
    Case* largest = nullptr;
    for (Case& k : p.cases)
      if (k.fits) {
        all = pool_max(all, k.pool);
        if (!largest || k.gpu_bytes > largest->gpu_bytes) largest = &k;
      }
    if (!largest || p.gpu_bytes(all) <= available) {
      p.pool = all;
      break;
    }
    largest->fits = false;
  }
  return p;
}

void print_plan(FILE* f, const Options& o, const Plan& p, int layers, int full_layers) {
  const ModelConfig& c = p.config;
  std::fprintf(
      f, "%s %s, %d of %d layers + MTP, %s, %s communicator: %d rank(s) on each of %d GPU(s)\n",
      o.model.c_str(), o.fmt.c_str(), layers, full_layers, p.layout.c_str(), o.comm.c_str(),
      p.ranks_per_gpu, p.gpus);
  for (int w = 0; w < p.world; ++w) {
    const MemoryPool& r = p.ranks[size_t(w)];
    // Consecutive ranks with the same figures on one line.
    int last = w;
    while (last + 1 < p.world && p.ranks[size_t(last + 1)].weights == r.weights &&
           p.ranks[size_t(last + 1)].activations == r.activations)
      ++last;
    const std::string who = last > w ? cat("ranks ", w, "-", last, " each") : cat("rank ", w);
    std::fprintf(f,
                 "%s: weights %.2f GiB, activations %.2f GiB, reserve %.2f GiB, cache %.2f "
                 "GiB (its dp group's pool: %d sequences, C4 %d / C128 %d pages of %d)\n",
                 who.c_str(), gib(double(r.weights)), gib(double(r.activations)),
                 gib(double(r.reserve)), gib(double(cache_bytes(c, p.pool))), p.pool.max_seqs,
                 p.pool.pages[int(PageKind::kC4)], p.pool.pages[int(PageKind::kC128)],
                 p.pool.page_size);
    w = last;
  }
  std::fprintf(f,
               "per GPU: %.2f GiB planned (incl. %.1f GiB slack for graphs / NCCL / CUPTI) of "
               "%.2f GiB; without the cache %.2f GiB%s\n",
               gib(p.gpu_bytes(p.pool)), gib(kSlackBytes), gib(p.available),
               gib(p.gpu_bytes(nullptr)),
               p.base_fits() ? "" : ": the weights and activations alone DO NOT FIT");
  for (const Case& k : p.cases) {
    std::string gs;
    for (int b : k.groups) gs += (gs.empty() ? "" : "+") + std::to_string(b);
    std::fprintf(f, "decode b=%3d (groups %s) ctx=%6lld: %s (%.2f GiB per GPU with its own pool)\n",
                 k.batch, gs.c_str(), (long long)k.ctx,
                 k.fits          ? "runs"
                 : p.base_fits() ? "SKIPPED: the cache does not fit"
                                 : "SKIPPED: the model does not fit",
                 gib(k.gpu_bytes));
  }
  if (o.prefill)
    std::fprintf(f,
                 "prefill %d tokens in steps of %d: one sequence on group 0; one per group (%d)\n",
                 kPrefillTokens, o.step_tokens, o.dp);
}

// ---- rooflines ----------------------------------------------------------------------------------

// Rank 0's share of a step (the largest dp group's first rank): the layers' dense work on its
// group's `rows` (with tp the attention and wo_a divided over the tp ranks; the rest whole), the
// router on them, the experts it owns for its expert group's `ep_rows` rows, the head on its
// group's rows. ctx 0: a prefill of `rows` tokens from position 0 (depth_model.h).
Cost rank_cost(const ModelConfig& c, int layers, ExpertFormat fmt, const ParallelConfig& p,
               int rows, int ep_rows, int64_t ctx) {
  Cost t = head_cost(c, rows);
  const double E = c.n_routed_experts, K = c.n_activated_experts, El = E / p.ep;
  const double dim = c.dim, inter = c.moe_inter_dim;
  const double bits = fmt == ExpertFormat::kMxfp4 ? 4.25 : 4.5;
  const double expert_bytes = 3 * inter * dim * bits / 8;
  for (int b = 0; b < layers; ++b) {
    std::map<std::string, Cost> k = layer_costs(c, c.ratio(b), fmt, rows, ctx);
    for (const char* cls : {"attention", "wo_a"}) {
      k[cls].bytes /= p.tp;
      k[cls].fp8_flops /= p.tp;
      k[cls].bf16_flops /= p.tp;
    }
    Cost& moe = k["moe"];
    const double touched = El * (1 - std::pow(1 - K / E, double(ep_rows)));
    moe.bytes = E * dim * 2 + touched * expert_bytes + 2.0 * rows * dim * 2;
    moe.fp8_flops = 0;
    moe.bf16_flops = 2.0 * rows * E * dim + 2.0 * (double(ep_rows) * K / p.ep) * 3 * inter * dim;
    t += total(k);
  }
  return t;
}

// ---- communication share ------------------------------------------------------------------------

// "" when the op is not communication; else its collective.
std::string comm_kind(const bench::TracedOp& op) {
  if (!op.kernel) return "";
  const std::string& n = op.name;
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (n.rfind("nccl", 0) == 0) {
    if (has("SendRecv") || has("AllToAll")) return "all_to_all";
    if (has("AllGather")) return "all_gather";
    if (has("AllReduce")) return "all_reduce";
    if (has("ReduceScatter")) return "reduce_scatter";
    if (has("Broadcast")) return "broadcast";
    return "nccl_other";
  }
  if (n == "publish_and_wait_kernel" || n == "gather_kernel" || n == "done_and_wait_kernel")
    return "inproc_collective";
  return "";
}

// Device time covered by a set of intervals (ns -> us).
double covered_us(std::vector<std::pair<uint64_t, uint64_t>> iv) {
  std::sort(iv.begin(), iv.end());
  uint64_t total = 0, lo = 0, hi = 0;
  bool open = false;
  for (const auto& [a, b] : iv) {
    if (!open || a > hi) {
      if (open) total += hi - lo;
      lo = a, hi = b, open = true;
    } else {
      hi = std::max(hi, b);
    }
  }
  if (open) total += hi - lo;
  return double(total) / 1000.0;
}

struct RankComm {
  int rank = -1;      // -1: not matched to a rank (in-process, see label)
  std::string label;  // "rank 0", or "thread #k" when the rank is unknown
  int ops = 0, comm_ops = 0;
  double busy_us = 0, comm_us = 0, copies_us = 0, exchange_us = 0;
  double span_us = 0;  // its first op's start to its last op's end (the device side of the step)
  std::map<std::string, double> by_kind;
};

// The traced ops split by rank. NCCL: rank w runs on GPU w (one node). In-process: by the
// launching thread (one per rank), named after the rank whose stream the thread's ops ran on
// (CUPTI's stream id against cudaStreamGetId), else "thread #k" in order of first launch.
std::vector<RankComm> comm_by_rank(const std::vector<bench::TracedOp>& ops,
                                   ParallelCudaRunner& runner, bool nccl) {
  std::map<uint64_t, std::vector<const bench::TracedOp*>> by_key;
  std::vector<uint64_t> order;
  for (const bench::TracedOp& op : ops) {
    const uint64_t key = nccl ? op.device : op.thread;
    if (!by_key.count(key)) order.push_back(key);
    by_key[key].push_back(&op);
  }
  if (nccl) std::sort(order.begin(), order.end());
  std::map<unsigned long long, int> stream_rank;
  if (!nccl)
    for (int w = runner.first_rank(); w < runner.first_rank() + runner.local_ranks(); ++w) {
      unsigned long long id = 0;
      if (cudaStreamGetId(runner.model(w).stream(), &id) == cudaSuccess)
        stream_rank[id] = w;
      else
        cudaGetLastError();  // this call's own error only (no stream id: ranks by thread)
    }
  std::vector<RankComm> out;
  for (size_t i = 0; i < order.size(); ++i) {
    const auto& v = by_key[order[i]];
    RankComm r;
    if (nccl) {
      r.rank = int(order[i]);
    } else {
      std::map<uint32_t, int> streams;
      for (const bench::TracedOp* op : v) ++streams[op->stream];
      const auto most = std::max_element(streams.begin(), streams.end(),
                                         [](auto& a, auto& b) { return a.second < b.second; });
      const auto it = stream_rank.find(most->first);
      if (it != stream_rank.end()) r.rank = it->second;
    }
    r.label = r.rank >= 0 ? "rank " + std::to_string(r.rank) : "thread #" + std::to_string(i);
    std::vector<std::pair<uint64_t, uint64_t>> all, comm, copies, exch;
    std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> kinds;
    for (const bench::TracedOp* op : v) {
      const std::pair<uint64_t, uint64_t> iv{op->start, std::max(op->start, op->end)};
      all.push_back(iv);
      ++r.ops;
      const std::string k = comm_kind(*op);
      if (!k.empty()) {
        comm.push_back(iv);
        kinds[k].push_back(iv);
        ++r.comm_ops;
      } else if (!op->kernel) {
        copies.push_back(iv);
      } else if (op->demangled.find("dsv4::exchange::") != std::string::npos) {
        exch.push_back(iv);
      }
    }
    r.busy_us = covered_us(all);
    uint64_t lo = UINT64_MAX, hi = 0;
    for (const auto& [a, b] : all) lo = std::min(lo, a), hi = std::max(hi, b);
    r.span_us = hi > lo ? double(hi - lo) / 1000.0 : 0.0;
    r.comm_us = covered_us(comm);
    r.copies_us = covered_us(copies);
    r.exchange_us = covered_us(exch);
    for (auto& [k, iv] : kinds) r.by_kind[k] = covered_us(iv);
    out.push_back(r);
  }
  std::sort(out.begin(), out.end(), [](const RankComm& a, const RankComm& b) {
    return a.rank >= 0 && b.rank >= 0 ? a.rank < b.rank : a.label < b.label;
  });
  return out;
}

// ---- the run ------------------------------------------------------------------------------------

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

void sync_devices(int gpus) {
  int cur = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&cur));
  for (int d = 0; d < gpus; ++d) {
    DSV4_CUDA_CHECK(cudaSetDevice(d));
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  }
  DSV4_CUDA_CHECK(cudaSetDevice(cur));
}

void run(const Options& o) {
  const auto t_start = Clock::now();
  const bool nv = o.fmt == "nvfp4";
  const ExpertFormat fmt = nv ? ExpertFormat::kNvfp4 : ExpertFormat::kMxfp4;
  const Model m = o.model == "pro" ? pro_model(nv) : flash_model(nv);
  const int full_layers = int(m.real_ratios.size());
  const int n = o.layers > 0 ? o.layers : full_layers;
  DSV4_CHECK(n <= full_layers, "--layers ", n, ": the model has ", full_layers);
  const ModelConfig c = config_with_layers(m, n);
  const bool nccl = o.comm == "nccl";

  double available = o.gpu_gib * double(1ull << 30);
  int gpus_present = 0;
  if (!o.dry_run && !o.check_weights) {
    DSV4_CUDA_CHECK(cudaGetDeviceCount(&gpus_present));
    const ParallelLayout layout(c, ParallelConfig{o.dp, o.ep, o.tp});
    const int need = nccl ? layout.world() : 1;
    DSV4_CHECK(gpus_present >= need, o.comm, ": ", layout.describe(), " needs ", need,
               " GPU(s), this machine shows ", gpus_present);
    available = 1e300;
    for (int d = 0; d < need; ++d) {
      DSV4_CUDA_CHECK(cudaSetDevice(d));
      size_t free = 0, total = 0;
      DSV4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
      available = std::min(available, double(free));
    }
    DSV4_CUDA_CHECK(cudaSetDevice(0));
  }
  const Plan plan = make_plan(o, c, available);
  if (o.check_weights) {
    const auto t0 = Clock::now();
    const std::unique_ptr<HostWeights> hw = host_weights(m.name, c, fmt, o.seed);
    std::printf("%s: bound %zu blocks in %.1f s\n", hw->what.c_str(), hw->ref.blocks.size(),
                seconds_since(t0));
    return;
  }
  if (o.dry_run) {
    print_plan(stdout, o, plan, n, full_layers);
    for (const Case& k : plan.cases) {
      const Cost r =
          rank_cost(c, n, fmt, plan.parallel, k.groups[0], k.batch * o.ep / plan.world, k.ctx);
      std::printf("decode b=%3d ctx=%6lld: rank 0 roofline %8.1f us per step\n", k.batch,
                  (long long)k.ctx, r.bound_us());
    }
    if (o.prefill)
      std::printf(
          "prefill %d: rank 0 roofline %.1f us (one sequence on group 0)\n", kPrefillTokens,
          rank_cost(c, n, fmt, plan.parallel, kPrefillTokens, kPrefillTokens * o.ep / plan.world, 0)
              .bound_us());
    return;
  }
  print_plan(stderr, o, plan, n, full_layers);
  DSV4_CHECK(plan.base_fits(), plan.layout, ": the weights and activations take ",
             gib(plan.gpu_bytes(nullptr)), " GiB of the ", gib(available),
             " GiB free on a GPU (see above)");
  const std::string prefix = cat(m.name, " ", o.fmt, " ", plan.layout, " (", o.comm, ")");
  auto base_extra = [&](const std::string& phase, int batch, int64_t ctx, const char* per) {
    Extra e;
    e.kv("model", m.name).kv("fmt", o.fmt).kv("phase", phase).kv("batch", double(batch));
    e.kv("ctx", double(ctx)).kv("layers", double(n)).kv("full_layers", double(full_layers));
    e.kv("dp", double(o.dp)).kv("ep", double(o.ep)).kv("tp", double(o.tp));
    e.kv("world", double(plan.world)).kv("comm", o.comm).kv("graphs", double(o.graphs));
    e.kv("per", per);
    return e;
  };
  char shape[512];
  for (const Case& k : plan.cases)
    if (!k.fits) {
      std::snprintf(shape, sizeof shape,
                    "%s decode b=%d ctx=%lld SKIPPED: the cache does not fit (%.1f of %.1f GiB "
                    "per GPU)",
                    prefix.c_str(), k.batch, (long long)k.ctx, gib(k.gpu_bytes), gib(available));
      Extra e = base_extra("decode", k.batch, k.ctx, "world");
      e.kv("skipped", 1.0);
      emit("parallel_step_skipped", shape, 0, Cost{}, e.str());
    }

  // Weights on the host, then the runner (every rank uploads its shard).
  auto t0 = Clock::now();
  const std::unique_ptr<HostWeights> hw = host_weights(m.name, c, fmt, o.seed);
  std::fprintf(stderr, "[%s] weights: %s in %.1f s\n", prefix.c_str(), hw->what.c_str(),
               seconds_since(t0));
  t0 = Clock::now();
  CudaModelLimits lim;
  lim.max_tokens = o.step_tokens;
  lim.max_seqs = plan.pool.max_seqs;
  lim.max_context = *std::max_element(o.contexts.begin(), o.contexts.end()) + kTailTokens;
  lim.max_context = std::max<int64_t>(lim.max_context, kPrefillTokens + kTailTokens);
  lim.max_logit_rows = plan.pool.max_seqs;
  ParallelCudaOptions po;
  po.comm = nccl ? CudaCommKind::kNccl : CudaCommKind::kInProcess;
  po.device = 0;
  po.cuda_graphs = o.graphs;
  ParallelCudaRunner runner(hw->config, hw->ref, plan.parallel, plan.pool, lim, po);
  std::fprintf(stderr, "[%s] runner built in %.1f s\n", prefix.c_str(), seconds_since(t0));
  const int W = plan.world, gpus = plan.gpus;

  std::mt19937 rng(uint32_t(o.seed) + 7);
  auto random_tokens = [&](int count) {
    std::vector<int32_t> t(static_cast<size_t>(count));
    for (auto& x : t) x = int32_t(2 + rng() % uint32_t(c.vocab_size - 2));
    return t;
  };
  bench::KernelTrace trace;
  trace.set_markers({});
  const bool tracing = o.trace && bench::KernelTrace::available();

  // One traced step: per rank, its busy and communication time.
  // `mode`: "eager" or "graph" (how the traced step ran: a decode step's first sight of its
  // shape runs eagerly, later ones replay graphs).
  auto traced = [&](const std::function<void()>& step, const std::string& what, double step_us,
                    const Extra& world_extra, int batch, int64_t ctx, const std::string& phase,
                    const std::string& mode) {
    if (!tracing) {
      step();
      return;
    }
    sync_devices(gpus);
    if (!trace.begin()) {
      step();
      return;
    }
    step();
    sync_devices(gpus);
    const std::vector<bench::TracedOp> ops = trace.end();
    const std::vector<RankComm> ranks = comm_by_rank(ops, runner, nccl);
    double worst_share = 0, worst_comm = 0, worst_span = 0;
    for (const RankComm& r : ranks) {
      const double share = r.busy_us > 0 ? r.comm_us / r.busy_us : 0;
      worst_share = std::max(worst_share, share);
      worst_comm = std::max(worst_comm, r.comm_us);
      worst_span = std::max(worst_span, r.span_us);
      std::snprintf(shape, sizeof shape,
                    "%s %s: %s communication %.1f us of %.1f us busy (%.1f %%), traced %s step",
                    prefix.c_str(), what.c_str(), r.label.c_str(), r.comm_us, r.busy_us,
                    100 * share, mode.c_str());
      Extra e = base_extra(phase, batch, ctx, "rank");
      e.kv("mode", mode);
      e.kv("rank", double(r.rank)).kv("rank_label", r.label).kv("busy_us", r.busy_us);
      e.kv("span_us", r.span_us);
      e.kv("comm_us", r.comm_us).kv("comm_share_of_busy", share).kv("ops", double(r.ops));
      e.kv("comm_ops", double(r.comm_ops)).kv("copies_us", r.copies_us);
      e.kv("moe_exchange_kernels_us", r.exchange_us);
      for (const auto& [k, us] : r.by_kind) e.kv((k + "_us").c_str(), us);
      emit("parallel_step_comm_rank", shape, r.comm_us, Cost{}, e.str());
      std::fprintf(stderr, "[%s] %s (%s) %s: %d ops, busy %.0f us, communication %.0f us (%.1f %%)",
                   prefix.c_str(), what.c_str(), mode.c_str(), r.label.c_str(), r.ops, r.busy_us,
                   r.comm_us, 100 * share);
      for (const auto& [k, us] : r.by_kind) std::fprintf(stderr, ", %s %.0f", k.c_str(), us);
      std::fprintf(stderr, "\n");
    }
    int comm_ops = 0;
    for (const RankComm& r : ranks) comm_ops += r.comm_ops;
    if (int(ranks.size()) != W || comm_ops == 0)
      std::fprintf(stderr,
                   "[%s] %s (%s): WARNING: ops of %zu ranks/threads traced for %d ranks, %d "
                   "communication kernels%s\n",
                   prefix.c_str(), what.c_str(), mode.c_str(), ranks.size(), W, comm_ops,
                   mode == "graph" ? " (CUPTI may not see the nodes of graphs instantiated before "
                                     "tracing: the eager rows, or --no-graphs)"
                                   : "");
    std::snprintf(shape, sizeof shape,
                  "%s %s, traced %s step: communication of the worst rank %.1f us, %.1f %% of its "
                  "busy time, %.1f %% of the timed step",
                  prefix.c_str(), what.c_str(), mode.c_str(), worst_comm, 100 * worst_share,
                  step_us > 0 ? 100 * worst_comm / step_us : 0.0);
    Extra e;
    e.s << world_extra.str();
    e.first = world_extra.first;
    e.kv("comm_us_worst_rank", worst_comm).kv("comm_share_of_busy_worst_rank", worst_share);
    if (step_us > 0) e.kv("comm_share_of_step", worst_comm / step_us);
    e.kv("ranks_traced", double(ranks.size())).kv("mode", mode);
    // The traced step's device side (the longest rank's first op to last op): the timed step's
    // wall time less this is the host's part (inputs, logits download and sampling, launches).
    e.kv("device_span_us_worst_rank", worst_span);
    emit("parallel_step_comm", shape, worst_comm, Cost{}, e.str());
  };

  for (int64_t ctx : o.contexts) {
    bool any = false;
    for (const Case& k : plan.cases) any = any || (k.ctx == ctx && k.fits);
    if (!any) continue;
    // The prototypes: one per dp group, prefilled together in chunks.
    const auto tp0 = Clock::now();
    std::vector<int> proto;
    for (int g = 0; g < o.dp; ++g) proto.push_back(runner.open_sequence_on(g));
    for (int64_t done = 0; done < ctx;) {
      const int chunk = int(std::min<int64_t>(o.step_tokens, ctx - done));
      std::vector<StepInput> in;
      for (int id : proto) {
        StepInput x(id, random_tokens(chunk));
        x.logits = false;
        in.push_back(std::move(x));
      }
      runner.step(in);
      done += chunk;
    }
    std::fprintf(stderr, "[%s] prefilled %d prototype(s) of %lld tokens in %.1f s\n",
                 prefix.c_str(), o.dp, (long long)ctx, seconds_since(tp0));
    for (const Case& k : plan.cases) {
      if (k.ctx != ctx || !k.fits) continue;
      const auto tc = Clock::now();
      std::vector<int> seqs;
      for (int g = 0; g < o.dp; ++g)
        for (int i = 0; i < k.groups[size_t(g)]; ++i)
          seqs.push_back(runner.clone_sequence(proto[size_t(g)]));
      SamplingParams greedy;
      std::vector<SampleSpec> specs(seqs.size());
      for (SampleSpec& sp : specs) sp.params = &greedy;
      int nonfinite = 0;
      auto step = [&]() {
        std::vector<StepInput> in;
        for (size_t i = 0; i < seqs.size(); ++i) {
          StepInput x(seqs[i], random_tokens(1));
          x.logits = false;
          x.sample = &specs[i];
          in.push_back(std::move(x));
        }
        const StepOutput out = runner.step(in);
        for (const std::string& e : out.errors) nonfinite += !e.empty();
      };
      char what[96];
      std::snprintf(what, sizeof what, "decode b=%d ctx=%lld", k.batch, (long long)ctx);
      // The first step of a shape runs eagerly: traced (its collectives' times include the
      // ranks' host launch skew, and lazy loading on first use); then the capture and 2 warm
      // replays.
      Extra first = base_extra("decode", k.batch, ctx, "world");
      traced(step, what, 0, first, k.batch, ctx, "decode", "eager");
      for (int i = 0; i < 3; ++i) step();
      nonfinite = 0;
      const int64_t graph_steps0 = runner.graph_steps();
      std::vector<double> us;
      for (int i = 0; i < o.iters; ++i) {
        const auto a = Clock::now();
        step();
        us.push_back(seconds_since(a) * 1e6);
      }
      const double step_us = median(us);
      const int64_t graph_steps = runner.graph_steps() - graph_steps0;
      const Cost roof = rank_cost(c, n, fmt, plan.parallel, k.groups[0], k.batch * o.ep / W, ctx);
      const double tps = k.batch * 1e6 / step_us;
      std::string gs;
      for (int b : k.groups) gs += (gs.empty() ? "" : "+") + std::to_string(b);
      std::snprintf(shape, sizeof shape,
                    "%s %d layers: decode step (greedy samples, logits sampled on the host), "
                    "world b=%d (per dp group %s) ctx=%lld, %.0f tokens/s world, %.0f per GPU; "
                    "roofline: rank 0's share",
                    prefix.c_str(), n, k.batch, gs.c_str(), (long long)ctx, tps, tps / gpus);
      Extra e = base_extra("decode", k.batch, ctx, "world");
      e.kv("group_batches", gs)
          .kv("tokens_per_s_world", tps)
          .kv("tokens_per_s_per_gpu", tps / gpus);
      e.kv("iters", double(o.iters)).kv("graph_steps", double(graph_steps));
      e.kv("nonfinite_rows", double(nonfinite));
      emit("parallel_step_decode", shape, step_us, roof, e.str());
      if (nonfinite)
        std::fprintf(stderr, "[%s] WARNING: %d non-finite rows at b=%d ctx=%lld\n", prefix.c_str(),
                     nonfinite, k.batch, (long long)ctx);
      traced(step, what, step_us, e, k.batch, ctx, "decode", o.graphs ? "graph" : "eager");
      for (int id : seqs) runner.close_sequence(id);
      std::fprintf(stderr,
                   "[%s] b=%d ctx=%lld: step %.0f us, %.0f tokens/s (%.0f per GPU), %lld of %d "
                   "timed steps as graphs (%.1f s)\n",
                   prefix.c_str(), k.batch, (long long)ctx, step_us, tps, tps / gpus,
                   (long long)graph_steps, o.iters, seconds_since(tc));
    }
    for (int id : proto) runner.close_sequence(id);
  }

  // Prefill: one sequence of kPrefillTokens on group 0, then one per group at once.
  if (o.prefill) {
    const std::vector<int32_t> prompt = random_tokens(kPrefillTokens);
    for (int groups : o.dp > 1 ? std::vector<int>{1, o.dp} : std::vector<int>{1}) {
      std::vector<int> ids;
      auto step = [&]() {  // the prompt in chunks of --step-tokens
        for (int g = 0; g < groups; ++g) ids.push_back(runner.open_sequence_on(g));
        for (int done = 0; done < kPrefillTokens;) {
          const int chunk = std::min(o.step_tokens, kPrefillTokens - done);
          std::vector<StepInput> in;
          for (int id : ids) {
            StepInput x(id,
                        std::vector<int32_t>(prompt.begin() + done, prompt.begin() + done + chunk));
            // The last row's logits, as a prompt step returns.
            x.logits = done + chunk == kPrefillTokens;
            in.push_back(std::move(x));
          }
          runner.step(in);
          done += chunk;
        }
        for (int id : ids) runner.close_sequence(id);
        ids.clear();
      };
      step();  // warm-up
      std::vector<double> us;
      for (int i = 0; i < 3; ++i) {
        const auto a = Clock::now();
        step();
        us.push_back(seconds_since(a) * 1e6);
      }
      const double step_us = median(us);
      const int tokens = groups * kPrefillTokens;
      const Cost roof = rank_cost(c, n, fmt, plan.parallel, kPrefillTokens,
                                  groups * kPrefillTokens * o.ep / W, 0);
      std::snprintf(shape, sizeof shape,
                    "%s %d layers: prefill of %d tokens (%d sequence(s) of %d, %s), %.0f "
                    "tokens/s world, %.0f per GPU; roofline: rank 0's share",
                    prefix.c_str(), n, tokens, groups, kPrefillTokens,
                    groups == 1 ? "group 0, the others idle" : "one per dp group",
                    tokens * 1e6 / step_us, tokens * 1e6 / step_us / gpus);
      Extra e = base_extra("prefill", tokens, 0, "world");
      e.kv("sequences", double(groups))
          .kv("step_tokens", double(o.step_tokens))
          .kv("tokens_per_s_world", tokens * 1e6 / step_us);
      e.kv("tokens_per_s_per_gpu", tokens * 1e6 / step_us / gpus);
      emit("parallel_step_prefill", shape, step_us, roof, e.str());
      char what[96];
      std::snprintf(what, sizeof what, "prefill %d x %d", groups, kPrefillTokens);
      traced(step, what, step_us, e, tokens, 0, "prefill", "eager");
      std::fprintf(stderr, "[%s] %s: %.0f us, %.0f tokens/s\n", prefix.c_str(), what, step_us,
                   tokens * 1e6 / step_us);
    }
  }
  std::fprintf(stderr, "[%s] done in %.1f s\n", prefix.c_str(), seconds_since(t_start));
}

}  // namespace
}  // namespace dsv4

int main(int argc, char** argv) {
  using namespace dsv4;
  Options o;
  const char* usage =
      "usage: parallel_step_bench [flash|pro] [nvfp4|mxfp4] [--dp N] [--ep N] [--tp N] "
      "[--comm nccl|inproc] [--layers N] [--batches 1,32,128] [--contexts 4096,65536] "
      "[--iters N] [--step-tokens N] [--no-prefill] [--no-trace] [--no-graphs] [--seed N] "
      "[--dry-run] "
      "[--gpu-gib G] [--check-weights]\n";
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw Error(cat(a, " needs a value"));
        return argv[++i];
      };
      if (a == "flash" || a == "pro")
        o.model = a;
      else if (a == "nvfp4" || a == "mxfp4")
        o.fmt = a;
      else if (a == "--dp")
        o.dp = std::stoi(value());
      else if (a == "--ep")
        o.ep = std::stoi(value());
      else if (a == "--tp")
        o.tp = std::stoi(value());
      else if (a == "--comm") {
        o.comm = value();
        if (o.comm != "nccl" && o.comm != "inproc")
          throw Error(cat("--comm ", o.comm, ": nccl or inproc"));
      } else if (a == "--layers") {
        o.layers = std::stoi(value());
        if (o.layers < 1) throw Error(cat("--layers ", o.layers, ": at least 1"));
      } else if (a == "--batches") {
        o.batches.clear();
        for (int64_t b : parse_list(value())) o.batches.push_back(int(b));
      } else if (a == "--contexts")
        o.contexts = parse_list(value());
      else if (a == "--iters")
        o.iters = std::stoi(value());
      else if (a == "--step-tokens")
        o.step_tokens = std::stoi(value());
      else if (a == "--seed")
        o.seed = std::stoull(value());
      else if (a == "--no-prefill")
        o.prefill = false;
      else if (a == "--no-trace")
        o.trace = false;
      else if (a == "--no-graphs")
        o.graphs = false;
      else if (a == "--dry-run")
        o.dry_run = true;
      else if (a == "--check-weights")
        o.check_weights = true;
      else if (a == "--gpu-gib")
        o.gpu_gib = std::stod(value());
      else {
        std::fprintf(stderr, "%s", usage);
        return 2;
      }
    }
    if (o.dp < 1 || o.ep < 1 || o.tp < 1) throw Error("--dp, --ep and --tp are at least 1");
    if (o.iters < 1 || o.iters > 200) throw Error(cat("--iters ", o.iters, ": 1 to 200"));
    if (o.step_tokens < 128 || o.step_tokens > 8192)
      throw Error(cat("--step-tokens ", o.step_tokens, ": 128 to 8192"));
    if (o.gpu_gib <= 0) throw Error("--gpu-gib must be positive");
    for (int b : o.batches)
      if (b < 1 || b > 1024) throw Error(cat("batch ", b, " outside [1, 1024]"));
    for (int64_t x : o.contexts)
      if (x < 1 || x > (int64_t(1) << 20)) throw Error(cat("context ", x, " out of range"));
    if (o.contexts.empty() || o.batches.empty()) throw Error("no batches or contexts");
    run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parallel_step_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
