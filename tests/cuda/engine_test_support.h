// Shared pieces of the CUDA engine tests (tests/cuda/engine_*_test.cpp): building the CUDA
// model, runner and verifier from a checkpoint directory, BF16 host<->device copies, and the
// end-to-end logit checks of the golden README (the same thresholds as golden_e2e_test).
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
#include "io/checkpoint.h"
#include "model/cache_spec.h"
#include "model/weights.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/device.h"
#include "support/golden.h"

namespace dsv4::test {

#define DSV4_SKIP_WITHOUT_GPU()                                           \
  do {                                                                    \
    if (::dsv4::cuda::device_count() == 0)                                \
      GTEST_SKIP() << "needs a GPU: " << ::dsv4::cuda::describe_device(); \
  } while (0)

struct CudaStackOptions {
  int max_seqs = 4;
  int64_t max_context = 640;
  int page_size = 64;
  int max_step_tokens = 320;
  bool verify = false;
  bool graphs = false;
  bool exact_linears = false;
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

// BF16 device copies of float host values (BF16 values: exact) and back.
inline cuda::DeviceBuffer<uint16_t> to_device_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16(v[i]);
  return cuda::DeviceBuffer<uint16_t>(b);
}
inline std::vector<float> from_device_bf16(const void* p, size_t n) {
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> b(n);
  DSV4_CUDA_CHECK(cudaMemcpy(b.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = bf16_to_float(b[i]);
  return v;
}
inline void upload_bf16(cuda::DeviceBuffer<uint16_t>& dst, const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16(v[i]);
  dst.upload(b);
}
inline __nv_bfloat16* bf(cuda::DeviceBuffer<uint16_t>& b) {
  return reinterpret_cast<__nv_bfloat16*>(b.data());
}

// Teacher-forced logits of one sequence: `prompt_len` tokens in one step (or in chunks of
// `chunk`), then one token per step. Rows for positions 0..tokens.size()-1.
template <typename Runner>
std::vector<float> forced_logits(Runner& r, const std::vector<int32_t>& tokens, int prompt_len,
                                 int chunk = 0) {
  const int seq = r.open_sequence();
  std::vector<float> all;
  const int step = chunk > 0 ? chunk : prompt_len;
  for (int i = 0; i < prompt_len; i += step) {
    const int n = std::min(step, prompt_len - i);
    std::vector<float> l =
        r.step_logits({{seq, {tokens.begin() + i, tokens.begin() + i + n}, true}});
    all.insert(all.end(), l.begin(), l.end());
  }
  for (size_t p = prompt_len; p < tokens.size(); ++p) {
    std::vector<float> row = r.step_logits({{seq, {tokens[p]}, false}});
    all.insert(all.end(), row.begin(), row.end());
  }
  r.close_sequence(seq);
  return all;
}

// The golden README's end-to-end acceptance per case. Argmax agreement excuses rows whose
// reference top-2 logits are within near_tie (the README's greedy rule): two correct
// implementations that round differently pick either token of a near tie.
struct E2eTolerance {
  double min_cos = 0.999, mean_cos = 0.9999, max_abs = 0.7, argmax = 0.97, near_tie = 0.1;
};

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
