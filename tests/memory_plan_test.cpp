// The memory plan: its figures are the ones the engine allocates (CPU weights byte for byte,
// the cache pool as cache_bytes() of plan_cache()), and the backends consult it before loading,
// refusing what cannot fit with the figures instead of failing inside an allocation.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backends/cpu/loader.h"
#include "backends/cpu/weights.h"
#include "core/error.h"
#include "dsv4/engine.h"
#include "model/cache_spec.h"
#include "model/memory_plan.h"
#include "model/tiny_checkpoint.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

namespace fs = std::filesystem;

template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MemoryPlan, CpuWeightsAreTheBytesTheCpuBackendHolds) {
  for (const auto& [preset, fmt] :
       {std::pair{"flash", ExpertFormat::kMxfp4}, std::pair{"pro", ExpertFormat::kNvfp4}}) {
    TempDir d;
    write_tiny_checkpoint(tiny_preset(preset), fmt, 1, d.path(), tiny_init(preset));
    const LoadedModel m = load_cpu_model(d.path());
    const MemoryPlan p = plan_memory(m.config, m.scheme, MemoryPlanOptions{});
    ASSERT_EQ(p.pools.size(), 1u);
    EXPECT_EQ(p.pools[0].weights, cpu::weight_bytes(m.model->weights())) << preset;
  }
}

TEST(MemoryPlan, CacheIsThePoolTheCachesAllocate) {
  const ModelConfig c = tiny_preset("flash");
  const QuantScheme q = QuantScheme::load("/nonexistent", c);
  for (int64_t tokens : {1, 100, 4096, 100000})
    for (int seqs : {1, 3}) {
      MemoryPlanOptions o;
      o.max_tokens = tokens;
      o.max_sequences = seqs;
      o.page_size = 16;
      const MemoryPlan p = plan_memory(c, q, o);
      const CacheConfig want = plan_cache(c, seqs, tokens, 16, 0);
      for (int k = 0; k < kNumPageKinds; ++k) EXPECT_EQ(p.cache.pages[k], want.pages[k]);
      EXPECT_EQ(p.pools[0].cache, cache_bytes(c, want));
      EXPECT_EQ(p.pools[0].cache_min, p.pools[0].cache);  // the CPU allocates the whole pool
      EXPECT_EQ(p.step.tokens, std::min<int64_t>(kDefaultStepTokens, tokens * seqs));
    }
  // A cache budget: the pool plan_cache fits into it.
  MemoryPlanOptions o;
  o.max_tokens = 100000;
  o.cache_bytes = 8 << 20;
  const MemoryPlan p = plan_memory(c, q, o);
  EXPECT_EQ(p.pools[0].cache, cache_bytes(c, plan_cache(c, 1, 100000, 64, 8 << 20)));
  EXPECT_LE(p.pools[0].cache, 8 << 20);
}

TEST(MemoryPlan, CudaPlanKeepsTheBackendsStepGeometryAndAShrinkingPool) {
  const ModelConfig c = tiny_preset("flash");
  const QuantScheme q = QuantScheme::load("/nonexistent", c);
  MemoryPlanOptions o;
  o.backend = PlanBackend::kCuda;
  o.max_tokens = 1 << 22;
  const MemoryPlan p = plan_memory(c, q, o);
  // The indexer's score rows of a step stay within their budget.
  const int64_t score_row = (o.max_tokens / 4 + 8) * 2;
  EXPECT_EQ(p.step.tokens, kCudaScoreBudgetBytes / score_row);
  EXPECT_EQ(p.step.logit_rows, p.step.tokens);  // tiny vocab: every row fits the logits budget
  ASSERT_EQ(p.pools.size(), 1u);
  EXPECT_TRUE(p.cache_shrinks);
  EXPECT_EQ(p.pools[0].cache_min, cache_bytes(c, cache_fixed_part(c, 1, 64)));
  EXPECT_LT(p.pools[0].cache_min, p.pools[0].cache);
  EXPECT_EQ(p.pools[0].reserve, kCudaReserveBytes);
  o.verify = true;
  o.cache_bytes = 64 << 20;
  const MemoryPlan v = plan_memory(c, q, o);
  ASSERT_EQ(v.pools.size(), 2u);  // the GPU, and the host for the CPU ops' weights
  EXPECT_FALSE(v.cache_shrinks);
  EXPECT_EQ(v.pools[0].cache_min, v.pools[0].cache);
  EXPECT_EQ(v.pools[1].weights, plan_memory(c, q, MemoryPlanOptions{}).pools[0].weights);
}

TEST(MemoryPlan, RefusalNamesTheFigures) {
  ModelConfig c = tiny_preset("flash");
  c.window_size = 20'000'000;  // the 2e7 window: ~80 GB of window rings
  const MemoryPlan p = plan_memory(c, QuantScheme::load("/nonexistent", c), MemoryPlanOptions{});
  EXPECT_GT(p.pools[0].cache, int64_t(70) << 30);
  const std::string e =
      error_of([&] { require_fits(p.pools[0], int64_t(22) << 30, "MemAvailable"); });
  EXPECT_NE(e.find("not enough host memory: the model needs "), std::string::npos) << e;
  EXPECT_NE(e.find("cache " + human_bytes(p.pools[0].cache)), std::string::npos) << e;
  EXPECT_NE(e.find("but 22.0 GiB is available (MemAvailable)"), std::string::npos) << e;
  EXPECT_EQ(error_of([&] { require_fits(p.pools[0], p.pools[0].required(), "x"); }), "");
  EXPECT_EQ(error_of([&] { require_fits(p.pools[0], -1, "unknown"); }), "");
  // Sizes no machine has are refused before any int64 arithmetic could overflow.
  c.window_size = 1 << 30;
  c.n_layers = 1000;
  c.compress_ratios.assign(1001, 0);
  c.n_hash_layers = 0;
  MemoryPlanOptions big;
  big.max_sequences = 65536;
  EXPECT_NE(error_of([&] {
              plan_memory(c, QuantScheme::load("/x", c), big);
            }).find("more than any machine has"),
            std::string::npos);
}

TEST(MemoryPlan, EngineOpenRefusesWhatCannotFitBeforeAllocating) {
  TempDir d;
  write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kMxfp4, 2, d.path());
  nlohmann::json j = nlohmann::json::parse(std::ifstream(d / "config.json"));
  j["sliding_window"] = 1 << 30;  // within its bound; its rings take ~4 TB
  std::ofstream(d / "config.json") << j.dump();
  EngineOptions o;
  o.model_dir = d.path();
  o.max_tokens = 16;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { Engine::open(o); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(e.find("not enough host memory"), std::string::npos) << e;
  EXPECT_NE(e.find("TiB"), std::string::npos) << e;
  EXPECT_LT(s, 5.0) << "the refusal must come before loading or allocating";
}

TEST(MemoryPlan, HostAvailableIsKnownOnLinux) {
  const int64_t a = host_available_bytes();
  EXPECT_GT(a, 0);
  std::ifstream is("/proc/meminfo");
  std::string key;
  int64_t total_kb = 0;
  while (is >> key >> total_kb)
    if (key == "MemTotal:") break;
  EXPECT_LE(a, total_kb * 1024);
}

TEST(MemoryPlan, DescribeListsEveryFigure) {
  const ModelConfig c = tiny_preset("pro");
  MemoryPlanOptions o;
  o.backend = PlanBackend::kCuda;
  o.verify = true;
  const MemoryPlan p = plan_memory(c, QuantScheme::load("/x", c), o);
  const std::string s = describe_plan(p);
  for (const char* want :
       {"backend       cuda", "GPU 0 memory:", "  weights", "  cache ", "  cache (min)",
        "  activations", "  reserve", "  total", "host memory:", "(shrunk to the GPU memory left)"})
    EXPECT_NE(s.find(want), std::string::npos) << want << "\n" << s;
}

}  // namespace
}  // namespace dsv4::test
