// dsv4::Engine on the CUDA backend.
#include "runtime/cuda_engine.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "io/checkpoint.h"
#include "model/cpu_weights.h"
#include "model/cuda_model.h"
#include "model/cuda_verify.h"
#include "model/cuda_weights.h"
#include "model/weights.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/device.h"
#include "runtime/cuda_runner.h"
#include "runtime/sampler.h"

namespace dsv4 {
namespace {

constexpr int kDefaultMaxStepTokens = 8192;
// The indexer's score rows [step tokens, context / 4] BF16 are the one activation that grows
// with the context: the step is shortened to keep them within this.
constexpr int64_t kScoreBudgetBytes = 1ll << 30;
// Likewise the fp32 logits [rows, vocab] of a step (prompt_logits wants every row).
constexpr int64_t kLogitsBudgetBytes = 1ll << 30;
// Device memory left free after the cache pool (cuBLAS, CUDA graphs, the driver).
constexpr int64_t kReserveBytes = 512ll << 20;

class CudaEngine final : public Engine {
 public:
  explicit CudaEngine(const EngineOptions& o) : options_(o) {
    DSV4_CHECK(o.page_size > 0 && o.page_size <= 4096, "page size must be in [1, 4096]");
    DSV4_CHECK(o.max_sequences > 0, "max_sequences must be positive");
    DSV4_CHECK(o.max_tokens > 0, "max_tokens must be positive");
    DSV4_CHECK(o.max_step_tokens >= 0 && o.cache_bytes >= 0, "negative step or cache size");
    DSV4_CHECK(std::filesystem::is_directory(o.model_dir), o.model_dir,
               ": model directory does not exist");
    DSV4_CHECK(cuda::device_count() > 0, "backend 'cuda': no usable CUDA GPU (",
               cuda::describe_device(), ")");
    config_ = load_model_config((std::filesystem::path(o.model_dir) / "config.json").string());
    const QuantScheme scheme = QuantScheme::load(o.model_dir, config_);
    check_cuda_supported(config_);
    {
      Checkpoint ckpt(o.model_dir);
      const WeightsRef ref = bind_weights(ckpt, config_, scheme);
      size_t bytes = 0;
      for (const std::string& n : ckpt.names()) bytes += ckpt.get(n).nbytes;
      CudaModelWeights w = upload_cuda_weights(config_, ref, bytes >= (size_t(1) << 30));
      if (o.verify) cpu_weights_ = cpu::prepare_weights(config_, ref);

      CudaModelLimits lim;
      lim.max_seqs = o.max_sequences;
      lim.max_context = o.max_tokens;
      lim.exact_linears = o.exact_linears;
      int64_t step = o.max_step_tokens > 0 ? o.max_step_tokens
                                           : std::min<int64_t>(kDefaultMaxStepTokens, o.max_tokens);
      const int64_t score_row = (o.max_tokens / 4 + 8) * 2;
      if (o.max_step_tokens == 0)
        step = std::max<int64_t>(1, std::min(step, kScoreBudgetBytes / score_row));
      lim.max_tokens = int(std::max<int64_t>(step, o.max_sequences));
      lim.max_logit_rows = int(std::clamp<int64_t>(
          kLogitsBudgetBytes / (int64_t(config_.vocab_size) * 4), o.max_sequences, lim.max_tokens));
      model_ = std::make_unique<CudaModel>(config_, std::move(w), lim);
    }

    // The cache pool: the flag's size, else room for max_sequences x max_tokens, shrunk to the
    // memory left when that does not fit.
    CacheConfig cc;
    if (o.cache_bytes > 0) {
      cc = plan_cache(config_, o.max_sequences, o.max_tokens, o.page_size, o.cache_bytes);
    } else {
      cc = CacheConfig::for_capacity(config_, o.max_sequences, o.max_tokens, o.page_size);
      size_t free = 0, total = 0;
      DSV4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
      const int64_t avail = int64_t(free) - kReserveBytes;
      if (DeviceCache::bytes_needed(config_, cc) > avail) {
        cc = plan_cache(config_, o.max_sequences, o.max_tokens, o.page_size, avail);
        std::fprintf(stderr,
                     "dsv4: the GPU has room for a %lld MiB cache pool, less than %d sequences "
                     "of %lld tokens need; long sequences may find the cache full\n",
                     (long long)(avail >> 20), o.max_sequences, (long long)o.max_tokens);
      }
    }
    CudaRunnerOptions ro;
    ro.cuda_graphs = o.cuda_graphs;
    runner_ = std::make_unique<CudaRunner>(*model_, cc, ro);
    if (o.verify) {
      verifier_ =
          std::make_unique<CudaVerifier>(config_, cpu_weights_, runner_->cache(), model_->stream());
      runner_->set_verifier(verifier_.get());
    }
    info_.vocab_size = config_.vocab_size;
    info_.bos_token_id = config_.bos_token_id;
    info_.eos_token_id = config_.eos_token_id;
    info_.num_layers = config_.n_layers;
    info_.num_mtp_layers = config_.n_mtp_layers;
    info_.expert_format = config_.moe_quant_algo.empty() ? "MXFP4" : config_.moe_quant_algo;
  }

  const ModelInfo& info() const override { return info_; }

  std::vector<float> prompt_logits(const std::vector<int32_t>& prompt, int chunk) override {
    check_prompt(prompt, 0);
    DSV4_CHECK(chunk >= 0, "prefill chunk must be >= 0");
    Sequence s(*runner_);
    // Every row's logits: a step holds at most as many tokens as the planned logits rows.
    const size_t step = std::min<size_t>({chunk > 0 ? size_t(chunk) : prompt.size(), max_step(),
                                          size_t(model_->limits().max_logit_rows)});
    std::vector<float> logits;
    logits.reserve(prompt.size() * size_t(info_.vocab_size));
    for (size_t i = 0; i < prompt.size(); i += step) {
      const size_t n = std::min(step, prompt.size() - i);
      std::vector<float> l =
          runner_->step({{s.id, {prompt.begin() + i, prompt.begin() + i + n}, true}});
      logits.insert(logits.end(), l.begin(), l.end());
    }
    report();
    return logits;
  }

  std::vector<int32_t> generate(const std::vector<int32_t>& prompt,
                                const SamplingOptions& o) override {
    DSV4_CHECK(o.max_new_tokens >= 0, "max_new_tokens must be >= 0");
    check_prompt(prompt, o.max_new_tokens);
    Sampler sampler(o.temperature, o.seed);
    Sequence s(*runner_);
    std::vector<int32_t> out;
    std::vector<float> logits;
    for (size_t i = 0; i < prompt.size(); i += max_step()) {
      const size_t n = std::min(max_step(), prompt.size() - i);
      logits = runner_->step({{s.id, {prompt.begin() + i, prompt.begin() + i + n}, false}});
    }
    for (int64_t i = 0; i < o.max_new_tokens; ++i) {
      const int32_t next = sampler.sample(logits.data(), info_.vocab_size);
      out.push_back(next);
      if (o.stop_at_eos && next == info_.eos_token_id) break;
      if (i + 1 < o.max_new_tokens) logits = runner_->step({{s.id, {next}, false}});
    }
    report();
    return out;
  }

 private:
  struct Sequence {
    CudaRunner& r;
    int id;
    explicit Sequence(CudaRunner& runner) : r(runner), id(runner.open_sequence()) {}
    ~Sequence() { r.close_sequence(id); }
  };

  size_t max_step() const { return size_t(model_->limits().max_tokens); }

  void check_prompt(const std::vector<int32_t>& prompt, int64_t extra) const {
    DSV4_CHECK(!prompt.empty(), "empty prompt");
    for (int32_t t : prompt)
      DSV4_CHECK(t >= 0 && t < info_.vocab_size, "token id ", t, " out of range [0, ",
                 info_.vocab_size, ")");
    DSV4_CHECK(int64_t(prompt.size()) + extra <= options_.max_tokens, "prompt of ", prompt.size(),
               " tokens plus ", extra, " new ones exceeds max_tokens ", options_.max_tokens);
  }

  // Verify mode: what was checked, on stderr (stdout stays the command's output).
  void report() const {
    if (verifier_) std::fprintf(stderr, "%s\n", verifier_->summary().c_str());
  }

  EngineOptions options_;
  ModelConfig config_;
  cpu::ModelWeights cpu_weights_;  // verify mode only
  std::unique_ptr<CudaModel> model_;
  std::unique_ptr<CudaRunner> runner_;
  std::unique_ptr<CudaVerifier> verifier_;
  ModelInfo info_;
};

}  // namespace

std::unique_ptr<Engine> open_cuda_engine(const EngineOptions& o) {
  return std::make_unique<CudaEngine>(o);
}

void register_cuda_backend() {
  Engine::register_backend("cuda", &open_cuda_engine);
}

}  // namespace dsv4
