// Shared pieces of the CUDA engine tests (tests/cuda/engine_*_test.cpp): building the CUDA
// model, runner and verifier from a checkpoint directory, and the end-to-end logit checks of
// the golden README (the thresholds of golden_e2e_test: E2eTolerance, support/golden.h).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "backends/cpu/loader.h"
#include "backends/cpu/weights.h"
#include "backends/cuda/model.h"
#include "backends/cuda/runner.h"
#include "backends/cuda/verify.h"
#include "backends/cuda/weights.h"
#include "core/formats.h"
#include "cuda/cuda_support.h"
#include "cuda/gpu_test.h"
#include "io/checkpoint.h"
#include "model/cache_spec.h"
#include "model/weights.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/device.h"
#include "support/golden.h"

namespace dsv4::test {

struct CudaStackOptions {
  int max_seqs = 4;
  int64_t max_context = 640;
  int page_size = 64;
  int max_step_tokens = 320;
  bool verify = false;
  bool graphs = false;
  bool exact_linears = false;
  bool branches = true;  // CudaModelLimits::concurrent_branches
  // CudaModelLimits::moe_tiled_path / moe_tiled_tile (the tiled path's expert GEMM kernel).
  cuda::moe::MoeGemmPath moe_tiled_path = cuda::moe::MoeGemmPath::kTiled;
  int moe_tiled_tile = 0;
};

// The CUDA backend of one checkpoint: model, runner and (verify mode) the CPU weights and the
// verifier.
struct CudaStack {
  ModelConfig config;
  cpu::ModelWeights cpu_weights;
  std::unique_ptr<DeviceContext> context;  // outlives the model and the runner
  std::unique_ptr<CudaModel> model;
  std::unique_ptr<CudaRunner> runner;
  std::unique_ptr<CudaVerifier> verifier;
  int V() const { return config.vocab_size; }
};

inline std::unique_ptr<CudaStack> open_cuda_stack(const std::string& dir,
                                                  const CudaStackOptions& o = {}) {
  auto s = std::make_unique<CudaStack>();
  s->config = load_model_config((std::filesystem::path(dir) / "config.json").string());
  const QuantScheme scheme = QuantScheme::load(dir, s->config);
  Checkpoint ckpt(dir);
  const WeightsRef ref = bind_weights(ckpt, s->config, scheme);
  CudaModelWeights w = upload_cuda_weights(s->config, ref, false);
  if (o.verify) s->cpu_weights = cpu::prepare_weights(s->config, ref);
  CudaModelLimits lim;
  lim.max_tokens = o.max_step_tokens;
  lim.max_seqs = o.max_seqs;
  lim.max_context = o.max_context;
  lim.exact_linears = o.exact_linears;
  lim.concurrent_branches = o.branches;
  lim.moe_tiled_path = o.moe_tiled_path;
  lim.moe_tiled_tile = o.moe_tiled_tile;
  s->context = std::make_unique<DeviceContext>(0);
  s->model = std::make_unique<CudaModel>(*s->context, s->config, std::move(w), lim);
  CudaRunnerOptions ro;
  ro.cuda_graphs = o.graphs;
  s->runner = std::make_unique<CudaRunner>(
      *s->model, cache_capacity(s->config, o.max_seqs, o.max_context, o.page_size), ro);
  if (o.verify) {
    s->verifier = std::make_unique<CudaVerifier>(s->config, s->cpu_weights, s->runner->cache(),
                                                 s->model->stream());
    s->runner->set_verifier(s->verifier.get());
  }
  return s;
}

// The golden README's end-to-end acceptance of one comparison (E2eTolerance).
inline void expect_logits_close(const std::string& what, const std::vector<float>& ours,
                                const std::vector<float>& ref, int V, bool check_argmax = true,
                                const E2eTolerance& t = {}) {
  ASSERT_EQ(ours.size(), ref.size()) << what;
  const size_t rows = ours.size() / size_t(V);
  const LogitStats s = logit_stats(ours.data(), ref.data(), rows, size_t(V));
  size_t same = 0;
  for (size_t i = 0; i < ours.size(); ++i) same += std::memcmp(&ours[i], &ref[i], 4) == 0;
  const double excused = argmax_excusing_ties(ours.data(), ref.data(), rows, V, t.near_tie);
  std::printf("    %-40s %s; excusing near ties %.2f%%; bit-identical %.2f%%\n", what.c_str(),
              to_string(s).c_str(), 100.0 * excused,
              100.0 * double(same) / double(std::max<size_t>(1, ours.size())));
  EXPECT_GE(s.min_cos, t.min_cos) << what;
  EXPECT_GE(s.mean_cos, t.mean_cos) << what;
  EXPECT_LE(s.max_abs, t.max_abs) << what;
  if (check_argmax) {
    EXPECT_GE(excused, t.argmax) << what;
  }
}

inline size_t first_diff_row(const std::vector<float>& a, const std::vector<float>& b, int V) {
  for (size_t r = 0; r < std::min(a.size(), b.size()) / size_t(V); ++r)
    if (std::memcmp(a.data() + r * V, b.data() + r * V, size_t(V) * 4) != 0) return r;
  return size_t(-1);
}

}  // namespace dsv4::test
