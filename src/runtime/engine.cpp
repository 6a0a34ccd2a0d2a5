// dsv4::Engine on the CPU backend.
#include "dsv4/engine.h"

#include <map>

#include "core/error.h"
#include "runtime/cpu_runner.h"
#include "runtime/model_loader.h"
#include "runtime/sampler.h"

namespace dsv4 {
namespace {

class CpuEngine final : public Engine {
 public:
  explicit CpuEngine(const EngineOptions& o) : options_(o), model_(load_cpu_model(o.model_dir)) {
    DSV4_CHECK(o.page_size > 0 && o.page_size <= 4096, "page size must be in [1, 4096]");
    DSV4_CHECK(o.max_sequences > 0, "max_sequences must be positive");
    DSV4_CHECK(o.max_tokens > 0, "max_tokens must be positive");
    const ModelConfig& c = model_.config;
    info_.vocab_size = c.vocab_size;
    info_.bos_token_id = c.bos_token_id;
    info_.eos_token_id = c.eos_token_id;
    info_.num_layers = c.n_layers;
    info_.num_mtp_layers = c.n_mtp_layers;
    info_.expert_format = c.moe_quant_algo.empty() ? "MXFP4" : c.moe_quant_algo;
    runner_ = std::make_unique<CpuRunner>(
        *model_.model, CacheConfig::for_capacity(c, o.max_sequences, o.max_tokens, o.page_size));
  }

  const ModelInfo& info() const override { return info_; }

  std::vector<float> prompt_logits(const std::vector<int32_t>& prompt, int chunk) override {
    check_prompt(prompt, 0);
    DSV4_CHECK(chunk >= 0, "prefill chunk must be >= 0");
    Sequence s(*runner_);
    const size_t step = chunk > 0 ? size_t(chunk) : prompt.size();
    std::vector<float> logits;
    logits.reserve(prompt.size() * size_t(info_.vocab_size));
    for (size_t i = 0; i < prompt.size(); i += step) {
      const size_t n = std::min(step, prompt.size() - i);
      std::vector<float> l =
          runner_->step({{s.id, {prompt.begin() + i, prompt.begin() + i + n}, true}});
      logits.insert(logits.end(), l.begin(), l.end());
    }
    return logits;
  }

  std::vector<int32_t> generate(const std::vector<int32_t>& prompt,
                                const SamplingOptions& o) override {
    DSV4_CHECK(o.max_new_tokens >= 0, "max_new_tokens must be >= 0");
    check_prompt(prompt, o.max_new_tokens);
    Sampler sampler(o.temperature, o.seed);
    Sequence s(*runner_);
    std::vector<int32_t> out;
    std::vector<float> logits = runner_->step({{s.id, prompt, false}});
    for (int64_t i = 0; i < o.max_new_tokens; ++i) {
      const int32_t next = sampler.sample(logits.data(), info_.vocab_size);
      out.push_back(next);
      if (o.stop_at_eos && next == info_.eos_token_id) break;
      if (i + 1 < o.max_new_tokens) logits = runner_->step({{s.id, {next}, false}});
    }
    return out;
  }

 private:
  // A sequence for the length of one request.
  struct Sequence {
    CpuRunner& r;
    int id;
    explicit Sequence(CpuRunner& runner) : r(runner), id(runner.open_sequence()) {}
    ~Sequence() { r.close_sequence(id); }
  };

  void check_prompt(const std::vector<int32_t>& prompt, int64_t extra) const {
    DSV4_CHECK(!prompt.empty(), "empty prompt");
    for (int32_t t : prompt)
      DSV4_CHECK(t >= 0 && t < info_.vocab_size, "token id ", t, " out of range [0, ",
                 info_.vocab_size, ")");
    DSV4_CHECK(int64_t(prompt.size()) + extra <= options_.max_tokens, "prompt of ", prompt.size(),
               " tokens plus ", extra, " new ones exceeds max_tokens ", options_.max_tokens);
  }

  EngineOptions options_;
  LoadedModel model_;
  ModelInfo info_;
  std::unique_ptr<CpuRunner> runner_;
};

std::map<std::string, Engine::Factory>& backends() {
  static std::map<std::string, Engine::Factory> m;
  return m;
}

}  // namespace

void Engine::register_backend(const std::string& name, Factory factory) {
  DSV4_CHECK(name != "cpu" && factory != nullptr, "cannot register backend '", name, "'");
  backends()[name] = factory;
}

std::unique_ptr<Engine> Engine::open(const EngineOptions& o) {
  if (o.backend == "cpu") {
    DSV4_CHECK(!o.verify,
               "verify mode checks the CUDA backend against the CPU ops: it needs "
               "backend 'cuda'");
    return std::make_unique<CpuEngine>(o);
  }
  if (auto it = backends().find(o.backend); it != backends().end()) return it->second(o);
  if (o.backend == "cuda")
    throw Error(
        "backend 'cuda' is not available: this build has no CUDA backend (configure with nvcc "
        "and -DDSV4_CUDA=ON)");
  throw Error(cat("unknown backend '", o.backend, "' (cpu, cuda)"));
}

}  // namespace dsv4
