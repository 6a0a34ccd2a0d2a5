#include "backends/cuda/backend.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "backends/cpu/weights.h"
#include "backends/cuda/device_context.h"
#include "backends/cuda/model.h"
#include "backends/cuda/runner.h"
#include "backends/cuda/verify.h"
#include "backends/cuda/weights.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "model/cache_spec.h"
#include "model/weights.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/device.h"

namespace dsv4 {
namespace {

constexpr int kDefaultMaxStepTokens = 8192;
// The indexer's score rows [step tokens, context / 4] BF16 are the one activation that grows
// with the context: the step is shortened to keep them within this.
constexpr int64_t kScoreBudgetBytes = 1ll << 30;
// Likewise the fp32 logits [rows, vocab] of a step (prompt logits want every row).
constexpr int64_t kLogitsBudgetBytes = 1ll << 30;
// Device memory left free after the cache pool (cuBLAS, CUDA graphs, the driver).
constexpr int64_t kReserveBytes = 512ll << 20;

}  // namespace

std::unique_ptr<Runner> open_cuda_runner(const RunnerOptions& o) {
  DSV4_CHECK(o.page_size > 0 && o.page_size <= 4096, "page size must be in [1, 4096]");
  DSV4_CHECK(o.max_sequences > 0, "max_sequences must be positive");
  DSV4_CHECK(o.max_tokens > 0, "max_tokens must be positive");
  DSV4_CHECK(o.max_step_tokens >= 0 && o.cache_bytes >= 0, "negative step or cache size");
  DSV4_CHECK(std::filesystem::is_directory(o.model_dir), o.model_dir,
             ": model directory does not exist");
  DSV4_CHECK(cuda::device_count() > 0, "backend 'cuda': no usable CUDA GPU (",
             cuda::describe_device(), ")");
  auto owned = std::make_unique<CudaRunner::Owned>();
  const ModelConfig config =
      load_model_config((std::filesystem::path(o.model_dir) / "config.json").string());
  const QuantScheme scheme = QuantScheme::load(o.model_dir, config);
  check_cuda_supported(config);
  owned->context = std::make_unique<DeviceContext>(0);
  {
    Checkpoint ckpt(o.model_dir);
    const WeightsRef ref = bind_weights(ckpt, config, scheme);
    size_t bytes = 0;
    for (const std::string& n : ckpt.names()) bytes += ckpt.get(n).nbytes;
    CudaModelWeights w = upload_cuda_weights(config, ref, bytes >= (size_t(1) << 30));
    if (o.verify) owned->cpu_weights = cpu::prepare_weights(config, ref);

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
        kLogitsBudgetBytes / (int64_t(config.vocab_size) * 4), o.max_sequences, lim.max_tokens));
    owned->model = std::make_unique<CudaModel>(*owned->context, config, std::move(w), lim);
  }

  // The cache pool: the flag's size, else room for max_sequences x max_tokens, shrunk to the
  // memory left when that does not fit.
  CacheConfig cc;
  if (o.cache_bytes > 0) {
    cc = plan_cache(config, o.max_sequences, o.max_tokens, o.page_size, o.cache_bytes,
                    o.snapshot_slots);
  } else {
    cc = plan_cache(config, o.max_sequences, o.max_tokens, o.page_size, 0, o.snapshot_slots);
    size_t free = 0, total = 0;
    DSV4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    const int64_t avail = int64_t(free) - kReserveBytes;
    if (cache_bytes(config, cc) > avail) {
      cc = plan_cache(config, o.max_sequences, o.max_tokens, o.page_size, avail,
                      o.snapshot_slots);
      std::fprintf(stderr,
                   "dsv4: the GPU has room for a %lld MiB cache pool, less than %d sequences "
                   "of %lld tokens need; long sequences may find the cache full\n",
                   (long long)(avail >> 20), o.max_sequences, (long long)o.max_tokens);
    }
  }
  CudaRunnerOptions ro;
  ro.cuda_graphs = o.cuda_graphs;
  auto runner = std::make_unique<CudaRunner>(*owned->model, cc, ro);
  if (o.verify) {
    // The model's config, not this function's: the verifier keeps a reference.
    owned->verifier = std::make_unique<CudaVerifier>(owned->model->config(), owned->cpu_weights,
                                                     runner->cache(), owned->model->stream());
    runner->set_verifier(owned->verifier.get());
  }
  runner->adopt(std::move(owned));
  return runner;
}

void register_cuda_backend() {
  register_backend("cuda", &open_cuda_runner);
}

}  // namespace dsv4
