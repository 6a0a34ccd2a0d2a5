// dsv4::Engine: the engine loop over the Runner of the chosen backend.
#include "dsv4/engine.h"

#include <cstdio>

#include "backends/cpu/backend.h"
#include "core/error.h"
#include "model/backend_registry.h"
#include "runtime/engine_loop.h"

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

std::unique_ptr<Engine> Engine::open(const EngineOptions& o) {
  DSV4_CHECK(o.page_size > 0 && o.page_size <= 4096, "page size must be in [1, 4096]");
  DSV4_CHECK(o.max_sequences > 0, "max_sequences must be positive");
  DSV4_CHECK(o.max_tokens > 0, "max_tokens must be positive");
  DSV4_CHECK(o.max_step_tokens >= 0 && o.cache_bytes >= 0, "negative step or cache size");
  DSV4_CHECK(o.prefix_snapshots >= -1 && o.prefix_block > 0,
             "prefix_snapshots must be >= -1 and prefix_block > 0");
  RunnerFactory factory = o.backend == "cpu" ? &open_cpu_runner : find_backend(o.backend);
  if (!factory) {
    if (o.backend == "cuda")
      throw Error(
          "backend 'cuda' is not available: this build has no CUDA backend (configure with nvcc "
          "and -DDSV4_CUDA=ON)");
    throw Error(cat("unknown backend '", o.backend, "' (cpu, cuda)"));
  }
  RunnerOptions ro;
  ro.model_dir = o.model_dir;
  ro.page_size = o.page_size;
  ro.max_sequences = o.max_sequences;
  ro.snapshot_slots = o.prefix_snapshots < 0 ? o.max_sequences : o.prefix_snapshots;
  ro.max_tokens = o.max_tokens;
  ro.cache_bytes = o.cache_bytes;
  ro.max_step_tokens = o.max_step_tokens;
  ro.verify = o.verify;
  ro.cuda_graphs = o.cuda_graphs;
  ro.exact_linears = o.exact_linears;
  ro.dp = o.dp;
  ro.ep = o.ep;
  ro.tp = o.tp;
  ro.parallel_comm = o.parallel_comm;
  return std::make_unique<LoopEngine>(factory(ro), o);
}

}  // namespace dsv4
