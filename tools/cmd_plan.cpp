// dsv4 plan: the memory an engine would take for the options given (the estimator the
// backends consult when they open), against the memory available now.
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "args.h"
#include "commands.h"
#include "common.h"
#include "core/error.h"
#include "model/cache_spec.h"
#include "model/memory_plan.h"
#include "model/model_config.h"
#include "model/model_source.h"
#include "model/quant_scheme.h"
#include "runtime/model_source_of.h"
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
  DSV4_CHECK(a.has("--model") + a.has("--config") + a.has("--random-weights") == 1,
             "give exactly one of --model, --config and --random-weights");
  ModelSource source;
  std::string config_path;
  if (a.has("--config")) {
    for (const char* f : {"--format", "--weights-seed", "--layers", "--repeat-experts", "--vocab"})
      DSV4_CHECK(!a.has(f), f, " applies to --random-weights");
    config_path = a.str("--config");
    // The quantisation scheme beside the config (hf_quant_config.json: NVFP4 experts).
    source.model_dir = std::filesystem::path(config_path).parent_path().string();
  } else {
    EngineOptions e;
    model_options(a, e);
    source = model_source(e);
    config_path = source.random.enabled()
                      ? source.random.describe()
                      : (std::filesystem::path(e.model_dir) / "config.json").string();
  }
  ModelHeader header;
  if (a.has("--config")) {
    header.config = load_model_config(config_path);
    header.scheme = QuantScheme::load(source.model_dir, header.config);
  } else {
    header = open_model_header(source);
  }
  const ModelConfig& config = header.config;
  MemoryPlanOptions o;
  const int64_t gpus = a.integer("--gpus");
  DSV4_CHECK(gpus == 0 || !a.has("--backend") || a.str("--backend") == "cuda",
             "--gpus plans the cuda backend");
  o.backend = gpus > 0 || a.str("--backend") == "cuda" ? PlanBackend::kCuda : PlanBackend::kCpu;
  o.max_tokens = a.integer("--max-model-len");
  o.max_sequences = static_cast<int>(a.integer("--max-running"));
  o.page_size = static_cast<int>(a.integer("--page-size"));
  o.cache_bytes = a.integer("--cache-mb") << 20;
  o.max_step_tokens = static_cast<int>(a.integer("--max-step-tokens"));
  o.verify = a.has("--verify");
  o.exact_linears = a.has("--exact-linears");
  o.speculative_tokens = static_cast<int>(a.integer("--speculative-tokens"));
  o.repeated_experts = source.repeated_experts();
  if (o.backend == PlanBackend::kCpu)
    DSV4_CHECK(!o.verify && !o.exact_linears,
               "--verify and --exact-linears apply to --backend cuda");
  const bool tuple = a.has("--dp") || a.has("--ep") || a.has("--tp");
  // N GPUs without a layout: data-parallel attention and expert-parallel MoE over all of them.
  o.parallel = gpus > 0 && !tuple ? ParallelConfig{int(gpus), int(gpus), 1}
                                  : ParallelConfig{int(a.integer("--dp")), int(a.integer("--ep")),
                                                   int(a.integer("--tp"))};
  if (gpus > 0)
    DSV4_CHECK(o.parallel.world() == gpus, "the layout dp ", o.parallel.dp, ", ep ", o.parallel.ep,
               ", tp ", o.parallel.tp, " runs on max(dp x tp, ep) = ", o.parallel.world(),
               " GPUs, not --gpus ", gpus);
  else if (o.backend == PlanBackend::kCuda)
    DSV4_CHECK(o.parallel.single(), "a layout over ", o.parallel.world(), " GPUs: give --gpus ",
               o.parallel.world());
  // A snapshot slot per running sequence, as the engine opens by default (the prefix cache).
  o.snapshot_slots = o.max_sequences;
  const MemoryPlan plan = plan_memory(config, header.scheme, o);
  std::printf("model         %s: %d layers + %d MTP, hidden %d, vocab %d, sliding_window %d\n",
              config_path.c_str(), config.n_layers, config.n_mtp_layers, config.dim,
              config.vocab_size, config.window_size);
  if (source.random.enabled()) {
    const int64_t host = random_weights_bytes(source.random);
    std::printf(
        "random host   %lld bytes (%s): the generated weights, in host memory while the "
        "engine loads%s\n",
        (long long)host, human_bytes(host).c_str(),
        source.random.repeat_experts ? " (one routed expert per layer)" : "");
  }
  std::fputs(describe_plan(plan).c_str(), stdout);
  std::string refusal;
  bool unknown = false;
  for (const MemoryPool& pool : plan.pools) {
    std::string what;
    // --gpus: every GPU has --gpu-mb (the plan is for a machine other than this one).
    const bool given = gpus > 0 && pool.name != "host memory";
    const int64_t avail = given ? a.integer("--gpu-mb") << 20 : available(pool, &what);
    if (given) what = "--gpu-mb";
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
  if (gpus > 0 && refusal.empty() && plan.cache_shrinks) {
    // What the engine would take: the pool grown to the memory left on each GPU.
    const MemoryPool& g = plan.pools.at(0);
    const int64_t room = (a.integer("--gpu-mb") << 20) - g.weights - g.activations - g.reserve;
    const CacheConfig cc =
        plan_cache(config, o.max_sequences, o.max_tokens, o.page_size, room, o.snapshot_slots);
    const int64_t tokens =
        std::max<int64_t>(int64_t(cc.pages[int(PageKind::kC4)]) * 4 * o.page_size,
                          int64_t(cc.pages[int(PageKind::kC128)]) * 128 * o.page_size);
    std::printf(
        "cache room    %lld bytes (%s) per GPU: %lld tokens of context per data-parallel "
        "rank\n",
        (long long)cache_bytes(config, cc), human_bytes(cache_bytes(config, cc)).c_str(),
        (long long)tokens);
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
      "dsv4 plan (--model DIR | --config FILE | --random-weights PRESET) [--gpus N [--dp N --ep N "
      "--tp N]] [flags]",
      "Prints the weight, cache and activation bytes of an engine opened with these options (the\n"
      "estimate the backends consult when they open), per GPU with --gpus, and the memory\n"
      "available (this machine's now, or --gpu-mb per GPU with --gpus); exits 1 when it does\n"
      "not fit, with the reason on stderr.",
      model_flags("the model directory (config.json, *.safetensors)") +
          std::vector<Flag>{
              {"--config", "FILE", "a config.json alone (no checkpoint needed)"},
              {"--gpus",
               "N",
               "plan the cuda backend over N GPUs (one rank each)",
               "0",
               false,
               {},
               0,
               1024},
              {"--gpu-mb",
               "N",
               "with --gpus: each GPU's memory in MiB (default: an H200's)",
               "143771",
               false,
               {},
               1,
               1 << 30},
              {"--dp",
               "N",
               "data-parallel attention groups (--gpus alone: N)",
               "1",
               false,
               {},
               1,
               1024},
              {"--ep", "N", "expert-parallel ranks (--gpus alone: N)", "1", false, {}, 1, 1024},
              {"--tp", "N", "tensor-parallel ranks per attention group", "1", false, {}, 1, 1024},
              {"--max-model-len",
               "N",
               "tokens per sequence (prompt + output)",
               "4096",
               false,
               {},
               1,
               1 << 30},
              {"--max-running",
               "N",
               "sequences alive at once (per data-parallel rank)",
               "1",
               false,
               {},
               1,
               65536},
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
              speculative_flag(),
          },
      run};
  return c;
}

}  // namespace dsv4::cli
