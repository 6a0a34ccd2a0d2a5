// Does the CUDA engine run: `--backend cuda` through the public dsv4::Engine on a make-tiny
// checkpoint (generate, prompt logits, verify mode), next to the CPU engine; a cache pool too
// small for the prompt is a dsv4::Error. Small and quick to read in a log.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>

#include "backends/cuda/backend.h"
#include "core/error.h"
#include "cuda/engine_test_support.h"
#include "dsv4/engine.h"
#include "model/cache_spec.h"
#include "model/tiny_checkpoint.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

class EngineSmoke : public ::testing::Test {
 protected:
  void SetUp() override {
    DSV4_SKIP_WITHOUT_GPU();
    register_cuda_backend();
    write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kNvfp4, 1, dir_.path(),
                          tiny_init("flash"));
  }
  EngineOptions options(const std::string& backend) const {
    EngineOptions o;
    o.model_dir = dir_.path();
    o.backend = backend;
    o.max_tokens = 64;
    return o;
  }
  TempDir dir_;
};

TEST_F(EngineSmoke, GenerateAndLogitsMatchTheCpuEngine) {
  const std::vector<int32_t> prompt{0, 17, 42, 99};
  std::unique_ptr<Engine> gpu = Engine::open(options("cuda"));
  std::unique_ptr<Engine> cpu = Engine::open(options("cpu"));
  EXPECT_EQ(gpu->info().expert_format, "NVFP4");
  SamplingOptions s;
  s.max_new_tokens = 8;
  s.stop_at_eos = false;
  const std::vector<int32_t> g = gpu->generate(prompt, s), c = cpu->generate(prompt, s);
  auto line = [](const std::vector<int32_t>& v) {
    std::string out;
    for (int32_t t : v) out += std::to_string(t) + " ";
    return out;
  };
  std::printf("  generate cuda: %s\n  generate cpu:  %s\n", line(g).c_str(), line(c).c_str());
  ASSERT_EQ(g.size(), 8u);
  const int V = gpu->info().vocab_size;
  std::vector<int32_t> longer(prompt);
  for (int i = 0; i < 40; ++i) longer.push_back(2 + (i * 37) % (V - 2));
  expect_logits_close("prompt logits, one prefill", gpu->prompt_logits(longer, 0),
                      cpu->prompt_logits(longer, 0), V);
  expect_logits_close("prompt logits, chunks of 3", gpu->prompt_logits(longer, 3),
                      cpu->prompt_logits(longer, 3), V);
}

// --exact-linears through the public API: generation and prompt logits next to the CPU engine,
// and verify mode on that path too.
TEST_F(EngineSmoke, ExactLinears) {
  EngineOptions o = options("cuda");
  o.exact_linears = true;
  o.verify = true;
  std::unique_ptr<Engine> gpu = Engine::open(o);
  std::unique_ptr<Engine> cpu = Engine::open(options("cpu"));
  std::vector<int32_t> prompt{0};
  for (int i = 0; i < 40; ++i) prompt.push_back(2 + (i * 37) % (gpu->info().vocab_size - 2));
  expect_logits_close("exact linears: prompt logits", gpu->prompt_logits(prompt, 0),
                      cpu->prompt_logits(prompt, 0), gpu->info().vocab_size);
  SamplingOptions s;
  s.max_new_tokens = 4;
  s.stop_at_eos = false;
  EXPECT_EQ(gpu->generate(prompt, s).size(), 4u);
}

TEST_F(EngineSmoke, VerifyModeRuns) {
  EngineOptions o = options("cuda");
  o.verify = true;
  std::unique_ptr<Engine> e = Engine::open(o);
  std::vector<int32_t> prompt{0};
  for (int i = 0; i < 20; ++i) prompt.push_back(2 + i * 53);
  SamplingOptions s;
  s.max_new_tokens = 4;
  s.stop_at_eos = false;
  EXPECT_NO_THROW(e->generate(prompt, s));
  EXPECT_THROW(
      {
        EngineOptions c = options("cpu");
        c.verify = true;
        Engine::open(c);
      },
      Error);
}

TEST_F(EngineSmoke, SmallCachePoolIsAnError) {
  EngineOptions o = options("cuda");
  o.prefix_snapshots = 0;  // the pool of one sequence alone
  const ModelConfig c = tiny_preset("flash");
  CacheConfig fixed = cache_capacity(c, 1, o.max_tokens, o.page_size);
  fixed.pages[1] = fixed.pages[2] = 0;
  // The flag budgets the stores (cache_bytes); the device cache's MTP state comes on top.
  o.cache_bytes = cache_bytes(c, fixed) + 1;  // window rings only
  std::unique_ptr<Engine> e = Engine::open(o);
  try {
    e->prompt_logits({0, 5, 6, 7, 8, 9}, 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    std::printf("  %s\n", err.what());
    // The engine loop finds that the pool can never hold the request (it does not wait).
    EXPECT_NE(std::string(err.what()).find("cannot be scheduled"), std::string::npos) << err.what();
  }
  // Too small for the window rings: refused at open.
  o.cache_bytes = 1024;
  EXPECT_THROW(Engine::open(o), Error);
}

// --random-weights on the CUDA backend: the fixture's checkpoint generated in memory loads
// through the same paths (one rank, and the parallel runner slicing it per rank, in-process on
// GPU 0, repeated experts aliasing one buffer) and gives the checkpoint's logits bit for bit.
TEST_F(EngineSmoke, RandomWeightsGiveTheCheckpointsLogitsBitForBit) {
  std::vector<int32_t> prompt{0};
  for (int i = 0; i < 40; ++i) prompt.push_back(2 + (i * 37) % 2046);
  auto random = [](EngineOptions o, bool repeat) {
    o.model_dir.clear();
    o.random_weights.preset = "flash";
    o.random_weights.format = "nvfp4";
    o.random_weights.seed = 1;
    o.random_weights.repeat_experts = repeat;
    return o;
  };
  auto same = [&](const char* what, const EngineOptions& a, const EngineOptions& b) {
    const std::vector<float> x = Engine::open(a)->prompt_logits(prompt, 0);
    const std::vector<float> y = Engine::open(b)->prompt_logits(prompt, 0);
    ASSERT_EQ(x.size(), prompt.size() * 2048u) << what;
    ASSERT_EQ(x.size(), y.size()) << what;
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0) << what;
  };
  same("one rank", options("cuda"), random(options("cuda"), false));
  TempDir repeated;
  TinyInit init = tiny_init("flash");
  init.repeat_experts = true;
  write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kNvfp4, 1, repeated.path(), init);
  EngineOptions par = options("cuda");
  par.model_dir = repeated.path();
  par.dp = par.ep = 2;
  par.parallel_comm = "inproc";
  same("dp 2 x ep 2 in-process, repeated experts", par, random(par, true));
}

}  // namespace
}  // namespace dsv4::test
