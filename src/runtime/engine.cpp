// dsv4::Engine: the engine loop over the Runner of the chosen backend.
#include "dsv4/engine.h"

#include <cstdio>
#include <filesystem>

#include "backends/cpu/backend.h"
#include "comm/collective_aborted.h"
#include "comm/rendezvous.h"
#include "core/error.h"
#include "model/backend_registry.h"
#include "model/model_source.h"
#include "model/node_wire.h"
#include "model/parallel_layout.h"
#include "runtime/engine_loop.h"
#include "runtime/model_source_of.h"

namespace dsv4 {
namespace {

class LoopEngine final : public Engine {
 public:
  LoopEngine(std::unique_ptr<Runner> runner, const EngineOptions& o)
      : loop_(std::move(runner), loop_options(o)) {}

  const ModelInfo& info() const override { return loop_.info(); }

  uint64_t add_request(const std::vector<int32_t>& prompt, const SamplingOptions& s,
                       int n) override {
    return loop_.add(prompt, s, n);
  }
  std::vector<RequestOutput> step() override { return loop_.step(); }
  void cancel(uint64_t id) override { loop_.cancel(id); }
  bool has_work() const override { return loop_.has_work(); }
  EngineStats stats() const override { return loop_.stats(); }

  std::vector<float> prompt_logits(const std::vector<int32_t>& prompt, int chunk) override {
    DSV4_CHECK(chunk >= 0, "prefill chunk must be >= 0");
    SamplingOptions s;
    s.max_new_tokens = 0;
    const uint64_t id = loop_.add(prompt, s, 1, true, chunk);
    while (loop_.has_work()) loop_.step();
    std::vector<float> l = loop_.take_prompt_logits(id);
    report();
    return l;
  }

  std::vector<int32_t> generate(const std::vector<int32_t>& prompt,
                                const SamplingOptions& s) override {
    const uint64_t id = loop_.add(prompt, s, 1);
    std::vector<int32_t> out;
    while (loop_.has_work()) {
      for (const RequestOutput& o : loop_.step()) {
        if (o.request != id) continue;
        out.insert(out.end(), o.tokens.begin(), o.tokens.end());
        if (o.finish == FinishReason::kError) throw Error(o.error);
      }
    }
    report();
    return out;
  }

 private:
  static EngineLoopOptions loop_options(const EngineOptions& o) {
    EngineLoopOptions l;
    l.max_running = o.max_sequences;
    l.max_step_tokens = o.max_step_tokens;
    l.max_tokens = o.max_tokens;
    l.prefix_snapshots = snapshots(o);
    l.prefix_block = o.prefix_block;
    l.speculative_tokens = o.speculative_tokens;
    l.speculative_rollback = o.speculative_restore ? Rollback::kRestore : Rollback::kRerun;
    return l;
  }
  static int snapshots(const EngineOptions& o) {
    return o.prefix_snapshots < 0 ? o.max_sequences : o.prefix_snapshots;
  }
  // Verify mode: what was checked, on stderr (stdout stays the command's output).
  void report() {
    const std::string r = loop_.runner().report();
    if (!r.empty()) std::fprintf(stderr, "%s\n", r.c_str());
  }

  EngineLoop loop_;
};

}  // namespace

namespace {

RunnerFactory factory_of(const std::string& backend) {
  RunnerFactory factory = backend == "cpu" ? &open_cpu_runner : find_backend(backend);
  if (!factory) {
    if (backend == "cuda")
      throw Error(
          "backend 'cuda' is not available: this build has no CUDA backend (configure with nvcc "
          "and -DDSV4_CUDA=ON)");
    throw Error(cat("unknown backend '", backend, "' (cpu, cuda)"));
  }
  return factory;
}

RandomWeights random_weights(const RandomWeightsOptions& o) {
  RandomWeights r;
  if (o.preset.empty()) return r;
  DSV4_CHECK(o.format == "mxfp4" || o.format == "nvfp4", "random weights: format '", o.format,
             "' is not one of mxfp4, nvfp4");
  DSV4_CHECK(o.layers >= 0, "random weights: layers must be >= 0 (0: every layer)");
  DSV4_CHECK(o.vocab >= 0, "random weights: vocab must be >= 0 (0: the config's)");
  r.preset = o.preset;
  r.format = o.format == "nvfp4" ? ExpertFormat::kNvfp4 : ExpertFormat::kMxfp4;
  r.seed = o.seed;
  r.layers = o.layers;
  r.repeat_experts = o.repeat_experts;
  r.vocab = o.vocab;
  return r;
}

// What the nodes compare: config.json's text, or the random weights' options and config.
std::string config_text(const EngineOptions& o) {
  const ModelSource s = model_source(o);
  if (!s.random.enabled())
    DSV4_CHECK(std::filesystem::exists(std::filesystem::path(o.model_dir) / "config.json"),
               o.model_dir, ": no config.json");
  return model_identity(s);
}

// The checks every node makes before meeting the others.
void check_nodes(const EngineOptions& o) {
  DSV4_CHECK(o.nnodes >= 1, "--nnodes must be at least 1");
  DSV4_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, "--node-rank ", o.node_rank,
             " must be in [0, ", o.nnodes, ") (--nnodes ", o.nnodes, ")");
  if (o.nnodes == 1) return;
  const ParallelConfig par{o.dp, o.ep, o.tp};
  DSV4_CHECK(par.world() % o.nnodes == 0, "--dp ", o.dp, " --ep ", o.ep, " --tp ", o.tp, ": ",
             par.world(), " rank(s) do not divide over --nnodes ", o.nnodes,
             " (every node runs the same number of ranks)");
  DSV4_CHECK(o.parallel_comm != "inproc" || o.backend != "cuda",
             "--comm inproc runs every rank in one process; several nodes need --comm nccl");
  DSV4_CHECK(!o.verify, "--verify is not offered with several nodes");
  DSV4_CHECK(o.node_timeout_s > 0, "the node timeout must be positive");
}

std::shared_ptr<Rendezvous> meet(const EngineOptions& o) {
  RendezvousOptions r;
  r.master_addr = o.master_addr;
  r.master_port = o.master_port;
  r.world = o.nnodes;
  r.rank = o.node_rank;
  r.timeout_s = o.node_timeout_s;
  r.peer_noun = "node";
  try {
    return std::make_shared<Rendezvous>(r);
  } catch (const Error& e) {
    throw Error(cat("multi-node run: node ", o.node_rank, " of ", o.nnodes, ": ", e.what()));
  }
}

constexpr char kNodeProtocol[] = "dsv4 multi-node 2";

// How long node 0 waits for the other nodes to read its failure report (they hang up once
// they have), and a node > 0 for node 0's verdict after it reported a failure.
constexpr double kReportLingerS = 10;
// How long node 0 waits at the start check for a node still loading its shards (longer than
// the rendezvous timeout: nodes load at their own pace; one that dies is seen at once).
constexpr double kStartWaitS = 1800;

// The start check, after every node built its runner (or failed to): each node > 0 tells node
// 0 it started (or reports why not: Rendezvous::fail), node 0 answers all with the verdict.
// A failure anywhere fails every node, each saying which node failed and why; no node goes on
// (node 0 to serve, the others to follow) after a failed start.
std::unique_ptr<Runner> start_node(const RunnerFactory& factory, const RunnerOptions& ro) {
  Rendezvous& rv = *ro.rendezvous;
  const int me = ro.node_rank;
  std::unique_ptr<Runner> runner;
  std::string failure;       // "node K failed to start: cause", the first failure seen here
  bool consequence = false;  // this node's ranks failed because another node's went away
  bool heard = false;        // `failure` is another node's report (node 0's: the verdict)
  try {
    runner = factory(ro);
  } catch (const PeerFailed& e) {
    failure = e.what();  // read while building
    heard = true;
  } catch (const CollectiveAborted& e) {
    failure = cat("node ", me, " failed to start: ", e.what());
    consequence = true;
  } catch (const std::exception& e) {
    failure = cat("node ", me, " failed to start: ", e.what());
  }
  if (me == 0) {
    if (failure.empty() || consequence) {
      try {
        rv.gather({}, consequence ? 5 : kStartWaitS);
      } catch (const PeerFailed& e) {
        failure = e.what();
      } catch (const Error& e) {
        // No report read (a node went away, or a slow node timed out the read): when this
        // node's own failure was only a consequence, say what reading the others found too.
        failure = failure.empty()
                      ? cat("a node failed to start: ", e.what())
                      : cat(failure, " (then, reading the other nodes: ", e.what(), ")");
      }
    }
    if (!failure.empty()) {
      // The report first (a node waiting in the rendezvous reads it), then this node's ranks
      // go (a node waiting in their collectives fails, then reads it).
      rv.fail(failure);
      runner.reset();
      rv.linger(kReportLingerS);
      throw Error(cat("multi-node run: ", failure));
    }
    rv.broadcast({});
    runner->nodes_started();
    return runner;
  }
  if (heard) throw Error(cat("multi-node run: ", failure));  // node 0's verdict: it knows
  if (!failure.empty()) {
    // Node 0 may have failed first (this node's collectives then failed as a consequence):
    // its verdict, when it sent one, names the cause.
    runner.reset();
    rv.fail(failure);
    try {
      rv.broadcast({}, kReportLingerS);
    } catch (const PeerFailed& e) {
      throw Error(cat("multi-node run: ", e.what()));
    } catch (const Error&) {
    }
    throw Error(cat("multi-node run: ", failure));
  }
  try {
    rv.gather({});
    rv.broadcast({}, kStartWaitS);
  } catch (const PeerFailed& e) {
    throw Error(cat("multi-node run: ", e.what()));
  } catch (const Error& e) {
    throw Error(cat("multi-node run: node ", me, " lost node 0 at the start: ", e.what()));
  }
  return runner;
}

}  // namespace

ModelSource model_source(const EngineOptions& o) {
  ModelSource s{o.model_dir, random_weights(o.random_weights)};
  s.check();
  return s;
}

std::unique_ptr<Engine> Engine::open(const EngineOptions& o) {
  DSV4_CHECK(o.page_size > 0 && o.page_size <= 4096, "page size must be in [1, 4096]");
  DSV4_CHECK(o.max_sequences > 0, "max_sequences must be positive");
  DSV4_CHECK(o.max_tokens > 0, "max_tokens must be positive");
  DSV4_CHECK(o.max_step_tokens >= 0 && o.cache_bytes >= 0, "negative step or cache size");
  DSV4_CHECK(o.prefix_snapshots >= -1 && o.prefix_block > 0,
             "prefix_snapshots must be >= -1 and prefix_block > 0");
  check_nodes(o);
  DSV4_CHECK(o.node_rank == 0, "node ", o.node_rank,
             " of a multi-node run follows node 0: Engine::run_node (the CLI does that for "
             "--node-rank > 0)");
  const ModelSource source = model_source(o);
  RunnerFactory factory = factory_of(o.backend);
  RunnerOptions ro;
  ro.model_dir = source.model_dir;
  ro.random_weights = source.random;
  ro.page_size = o.page_size;
  ro.max_sequences = o.max_sequences;
  ro.snapshot_slots = o.prefix_snapshots < 0 ? o.max_sequences : o.prefix_snapshots;
  ro.max_tokens = o.max_tokens;
  ro.cache_bytes = o.cache_bytes;
  ro.max_step_tokens = o.max_step_tokens;
  ro.verify = o.verify;
  ro.verify_first_layer = o.verify_first_layer;
  ro.verify_last_layer = o.verify_last_layer;
  ro.cuda_graphs = o.cuda_graphs;
  ro.exact_linears = o.exact_linears;
  ro.speculative_tokens = o.speculative_tokens;
  ro.dp = o.dp;
  ro.ep = o.ep;
  ro.tp = o.tp;
  ro.parallel_comm = o.parallel_comm;
  ro.nnodes = o.nnodes;
  if (o.nnodes > 1) {
    // What the other nodes need to open the same run: the backend, the model's config (to
    // compare with theirs), node 0's runner options.
    const std::string config = config_text(o);
    ro.rendezvous = meet(o);
    WireWriter w;
    w.str(kNodeProtocol);
    w.str(o.backend);
    w.str(config);
    put_runner_options(w, ro);
    ro.rendezvous->broadcast(w.bytes());
    return std::make_unique<LoopEngine>(start_node(factory, ro), o);
  }
  return std::make_unique<LoopEngine>(factory(ro), o);
}

void Engine::run_node(const EngineOptions& o) {
  check_nodes(o);
  DSV4_CHECK(o.nnodes > 1 && o.node_rank > 0,
             "run_node is for nodes > 0 of a multi-node run (--nnodes N, --node-rank 1..N-1)");
  const std::string config = config_text(o);
  RunnerOptions ro;
  ro.rendezvous = meet(o);
  const std::vector<uint8_t> m = ro.rendezvous->broadcast({});
  std::string backend;
  try {
    WireReader r(m);
    DSV4_CHECK(r.str() == kNodeProtocol,
               "multi-node run: node 0 speaks another protocol (a "
               "different dsv4 build?)");
    backend = r.str();
    DSV4_CHECK(backend == o.backend, "multi-node run: node 0 runs backend '", backend, "', node ",
               o.node_rank, " was given '", o.backend, "'");
    DSV4_CHECK(r.str() == config, "multi-node run: node ", o.node_rank, "'s ",
               o.model_dir.empty() ? model_source(o).describe() : o.model_dir + "/config.json",
               " differs from node 0's (every node needs the same checkpoint)");
    get_runner_options(r, ro);
    DSV4_CHECK(ro.nnodes == o.nnodes && ro.dp == o.dp && ro.ep == o.ep && ro.tp == o.tp,
               "multi-node run: node 0 runs --nnodes ", ro.nnodes, " --dp ", ro.dp, " --ep ", ro.ep,
               " --tp ", ro.tp, ", node ", o.node_rank, " was given --nnodes ", o.nnodes, " --dp ",
               o.dp, " --ep ", o.ep, " --tp ", o.tp);
  } catch (const Error& e) {
    // Node 0 is building its runner: it reads the report wherever it next hears from here,
    // and answers with its verdict (waited for, so that this node's connection stays open
    // until node 0 has read the report).
    std::string why = e.what();
    const std::string prefix = "multi-node run: ";
    if (why.compare(0, prefix.size(), prefix) == 0) why.erase(0, prefix.size());
    ro.rendezvous->fail(cat("node ", o.node_rank, " refused to start: ", why));
    try {
      ro.rendezvous->broadcast({}, kReportLingerS);
    } catch (const Error&) {
    }
    throw;
  }
  ro.model_dir = o.model_dir;
  ro.random_weights = model_source(o).random;
  ro.node_rank = o.node_rank;
  start_node(factory_of(backend), ro)->follow();
}

}  // namespace dsv4
