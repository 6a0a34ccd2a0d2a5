// dsv4 plan: the memory an engine would take for the options given (the estimator the
// backends consult when they open), against the memory available now.
#include <cstdio>
#include <filesystem>

#include "args.h"
#include "commands.h"
#include "common.h"
#include "core/error.h"
#include "model/memory_plan.h"
#include "model/model_config.h"
#include "model/quant_scheme.h"
#if defined(DSV4_WITH_CUDA)
#include "backends/cuda/backend.h"
#endif

namespace dsv4::cli {
namespace {

// Bytes free in the pool's memory now, or -1 with `what` saying why it is unknown.
int64_t available(const MemoryPool& pool, std::string* what) {
  if (pool.name == "host memory") {
    *what = "MemAvailable";
    return host_available_bytes();
  }
#if defined(DSV4_WITH_CUDA)
  std::string why;
  const int64_t free = cuda_free_device_bytes(&why);
  *what = free >= 0 ? "free on the GPU" : why;
  return free;
#else
  *what = "this build has no CUDA backend";
  return -1;
#endif
}

int run(const Args& a) {
  const std::string dir = a.str("--model");
  DSV4_CHECK(std::filesystem::is_directory(dir), dir, ": model directory does not exist");
  const ModelConfig config =
      load_model_config((std::filesystem::path(dir) / "config.json").string());
  MemoryPlanOptions o;
  o.backend = a.str("--backend") == "cuda" ? PlanBackend::kCuda : PlanBackend::kCpu;
  o.max_tokens = a.integer("--max-model-len");
  o.max_sequences = static_cast<int>(a.integer("--max-running"));
  o.page_size = static_cast<int>(a.integer("--page-size"));
  o.cache_bytes = a.integer("--cache-mb") << 20;
  o.max_step_tokens = static_cast<int>(a.integer("--max-step-tokens"));
  o.verify = a.has("--verify");
  o.exact_linears = a.has("--exact-linears");
  if (o.backend == PlanBackend::kCpu)
    DSV4_CHECK(!o.verify && !o.exact_linears,
               "--verify and --exact-linears apply to --backend cuda");
  const MemoryPlan plan = plan_memory(config, QuantScheme::load(dir, config), o);
  std::printf("model         %s: %d layers + %d MTP, hidden %d, vocab %d, sliding_window %d\n",
              dir.c_str(), config.n_layers, config.n_mtp_layers, config.dim, config.vocab_size,
              config.window_size);
  std::fputs(describe_plan(plan).c_str(), stdout);
  std::string refusal;
  bool unknown = false;
  for (const MemoryPool& pool : plan.pools) {
    std::string what;
    const int64_t avail = available(pool, &what);
    if (avail < 0) {
      std::printf("%s available: unknown (%s)\n", pool.name.c_str(), what.c_str());
      unknown = true;
      continue;
    }
    std::printf("%s available: %lld bytes (%s, %s)\n", pool.name.c_str(), (long long)avail,
                human_bytes(avail).c_str(), what.c_str());
    try {
      require_fits(pool, avail, what);
    } catch (const Error& e) {
      if (refusal.empty()) refusal = e.what();
    }
  }
  std::printf("fits: %s\n", !refusal.empty() ? "no" : unknown ? "unknown" : "yes");
  std::fflush(stdout);
  DSV4_CHECK(refusal.empty(), refusal);
  return 0;
}

}  // namespace

const Command& plan_command() {
  static const Command c{
      "plan",
      "the memory an engine would take: weights, cache, activations",
      "dsv4 plan --model DIR [flags]",
      "Prints the weight, cache and activation bytes of an engine opened with these options (the\n"
      "estimate the backends consult when they open) and the memory available now; exits 1 when\n"
      "it does not fit, with the reason on stderr.",
      std::vector<Flag>{
          {"--model", "DIR", "the model directory (config.json, *.safetensors)", "", true},
          {"--max-model-len",
           "N",
           "tokens per sequence (prompt + output)",
           "4096",
           false,
           {},
           1,
           1 << 30},
          {"--max-running", "N", "sequences alive at once", "1", false, {}, 1, 65536},
          {"--max-step-tokens",
           "N",
           "tokens per forward step, 0 = the backend's default",
           "0",
           false,
           {},
           0,
           1 << 30},
      } +
          std::vector<Flag>{
              {"--backend",
               "NAME",
               "the backend that would run the model",
               "cpu",
               false,
               {"cpu", "cuda"}},
              {"--page-size", "P", "cache entries per page", "64", false, {}, 1, 4096},
              {"--cache-mb",
               "N",
               "cache pool size in MiB, 0 = room for every sequence",
               "0",
               false,
               {},
               0,
               1 << 30},
              {"--verify", "", "cuda: the CPU ops' weights on the host as well"},
              {"--exact-linears", "", "cuda: the W8A16 path's activation buffers"},
          },
      run};
  return c;
}

}  // namespace dsv4::cli
