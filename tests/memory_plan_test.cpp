// The memory plan: its figures are the ones the engine allocates (CPU weights byte for byte,
// the cache pool as cache_bytes() of plan_cache()), and the backends consult it before loading,
// refusing what cannot fit with the figures instead of failing inside an allocation.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backends/cpu/loader.h"
#include "backends/cpu/weights.h"
#include "core/error.h"
#include "core/formats.h"
#include "dsv4/engine.h"
#include "io/checkpoint.h"
#include "model/cache_spec.h"
#include "model/memory_plan.h"
#include "model/model_config.h"
#include "model/model_source.h"
#include "model/parallel_layout.h"
#include "model/speculation.h"
#include "model/tiny_checkpoint.h"
#include "model/weights.h"
#include "ops/cpu/moe.h"
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

// Random weights with repeated experts (every routed expert of a block the same bytes): the CPU
// weights hold one dequantised expert a block -- the plan's figure, byte for byte -- and every
// expert id reads it; the MoE's output equals that of the same weights held once per expert.
TEST(MemoryPlan, RepeatedExpertsAreOneCpuCopyABlock) {
  for (const auto& [preset, fmt] :
       {std::pair{"flash", ExpertFormat::kMxfp4}, std::pair{"pro", ExpertFormat::kNvfp4}}) {
    SCOPED_TRACE(preset);
    ModelSource src;
    src.random.preset = preset;
    src.random.format = fmt;
    src.random.seed = 3;
    src.random.repeat_experts = true;
    const ModelHeader h = open_model_header(src);
    const std::unique_ptr<Checkpoint> ckpt = open_model_checkpoint(src);
    const WeightsRef ref = bind_weights(*ckpt, h.config, h.scheme);
    const cpu::ModelWeights w = cpu::prepare_weights(h.config, ref);
    MemoryPlanOptions o;
    o.repeated_experts = true;
    EXPECT_EQ(plan_memory(h.config, h.scheme, o).pools.at(0).weights, cpu::weight_bytes(w));
    EXPECT_LT(cpu::weight_bytes(w), plan_memory(h.config, h.scheme, {}).pools.at(0).weights);
    const int E = h.config.n_routed_experts;
    for (const cpu::BlockWeights& b : w.blocks) {
      ASSERT_EQ(b.ffn.experts.size(), 1u);
      ASSERT_EQ(b.ffn.n_experts(), E);
      for (int e = 0; e < E; ++e) EXPECT_EQ(&b.ffn.expert(e), &b.ffn.experts[0]);
    }
    // Expert-parallel ranks: each holds one copy of its range's expert a block.
    for (const ParallelConfig& par : {ParallelConfig{1, 2, 1}, ParallelConfig{2, 2, 2}}) {
      const ParallelLayout L(h.config, par);
      int64_t held = 0;
      for (int r = 0; r < L.world(); ++r)
        held += cpu::weight_bytes(cpu::prepare_weights(h.config, ref, cpu::shard_of(L, r)));
      MemoryPlanOptions po;
      po.repeated_experts = true;
      po.parallel = par;
      EXPECT_EQ(plan_memory(h.config, h.scheme, po).pools.at(0).weights, held) << L.describe();
    }
    // The block-0 MoE over a few rows against the same weights expanded to one copy per expert.
    const cpu::MoeWeights& once = w.blocks[0].ffn;
    cpu::MoeWeights each;
    each.gate = once.gate, each.bias = once.bias, each.tid2eid = once.tid2eid;
    each.shared = once.shared;
    for (int e = 0; e < E; ++e) each.experts.push_back(once.expert(e));
    const int n = 5, dim = h.config.dim;
    std::vector<float> x(size_t(n) * dim);
    for (size_t i = 0; i < x.size(); ++i) x[i] = round_bf16(std::sin(0.37f * float(i)));
    const std::vector<int32_t> tokens = {0, 5, 6, 7, 8};
    const cpu::MoeParams p{h.config.n_activated_experts, h.config.score_func, h.config.route_scale,
                           h.config.swiglu_limit};
    std::vector<float> y1(x.size()), y2(x.size());
    cpu::moe_forward(once, p, x.data(), tokens.data(), n, dim, y1.data());
    cpu::moe_forward(each, p, x.data(), tokens.data(), n, dim, y2.data());
    EXPECT_EQ(std::memcmp(y1.data(), y2.data(), 4 * y1.size()), 0);
  }
}

// Several ranks as threads: the plan's host weights are the bytes of every rank's shard as
// the CPU backend prepares it (experts by range, heads and output groups split), byte for byte.
TEST(MemoryPlan, ParallelCpuWeightsAreTheShardsTheRanksHold) {
  TempDir d;
  write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kNvfp4, 1, d.path(),
                        tiny_init("flash"));
  const ModelConfig c = load_model_config(d.path() + "/config.json");
  const QuantScheme scheme = QuantScheme::load(d.path(), c);
  const Checkpoint ckpt(d.path());
  const WeightsRef ref = bind_weights(ckpt, c, scheme);
  const int64_t one = plan_memory(c, scheme, MemoryPlanOptions{}).pools.at(0).weights;
  for (const ParallelConfig& par :
       {ParallelConfig{1, 2, 1}, ParallelConfig{2, 2, 1}, ParallelConfig{1, 4, 1},
        ParallelConfig{1, 1, 2}, ParallelConfig{2, 2, 2}}) {
    const ParallelLayout L(c, par);
    int64_t held = 0;
    for (int w = 0; w < L.world(); ++w)
      held += cpu::weight_bytes(cpu::prepare_weights(c, ref, cpu::shard_of(L, w)));
    MemoryPlanOptions o;
    o.parallel = par;
    const MemoryPlan p = plan_memory(c, scheme, o);
    ASSERT_EQ(p.pools.size(), 1u);
    EXPECT_EQ(p.pools[0].weights, held) << L.describe();
    EXPECT_GT(p.pools[0].weights, one) << L.describe();  // what is not split is replicated
    EXPECT_EQ(p.pools[0].cache, L.world() * plan_memory(c, scheme, {}).pools[0].cache);
  }
}

// The real checkpoints' configs (tests/data, from the spec's §1.1 numbers) over H200s: each
// rank holds its experts and a whole copy of the rest; V4-Flash fits two GPUs and not one,
// V4-Pro eight (with 2048-token steps) and not four; a layout that does not divide is an error.
TEST(MemoryPlan, RealConfigsOverSeveralGpus) {
  const std::string data = std::string(DSV4_SOURCE_DIR) + "/tests/data/";
  const int64_t h200 = int64_t(143771) << 20;
  auto plan = [&](const std::string& name, int gpus, int64_t len, int running, int step) {
    const ModelConfig c = load_model_config(data + "deepseek-v4-" + name + ".config.json");
    MemoryPlanOptions o;
    o.backend = PlanBackend::kCuda;
    o.max_tokens = len;
    o.max_sequences = running;
    o.snapshot_slots = running;
    o.max_step_tokens = step;
    o.parallel = {gpus, gpus, 1};
    return plan_memory(c, QuantScheme::load(data, c), o);
  };
  auto fits = [&](const MemoryPlan& p) {
    for (const MemoryPool& m : p.pools)
      if (!error_of([&] { require_fits(m, h200, "an H200"); }).empty()) return false;
    return true;
  };
  const MemoryPlan f1 = plan("flash", 1, 65536, 64, 0), f2 = plan("flash", 2, 65536, 64, 0);
  ASSERT_EQ(f2.pools.size(), 2u);
  EXPECT_EQ(f2.pools[0].weights, f2.pools[1].weights);
  // Two ranks hold the experts once and everything else twice.
  const ModelConfig fc = load_model_config(data + "deepseek-v4-flash.config.json");
  const std::vector<ExpectedTensor> inv = weight_inventory(fc, QuantScheme::load(data, fc));
  const ParallelLayout L(fc, {2, 2, 1});
  size_t n0 = rank_weight_inventory(inv, L, 0).size(), n1 = rank_weight_inventory(inv, L, 1).size();
  size_t experts = 0;
  for (const ExpectedTensor& t : inv) experts += t.name.find(".ffn.experts.") != std::string::npos;
  EXPECT_EQ(n0 + n1, 2 * inv.size() - experts);
  EXPECT_LT(f2.pools[0].weights, f1.pools[0].weights * 6 / 10);
  EXPECT_FALSE(fits(f1));
  EXPECT_TRUE(fits(f2));
  EXPECT_TRUE(fits(plan("pro", 8, 65536, 16, 2048)));
  EXPECT_FALSE(fits(plan("pro", 4, 65536, 16, 2048)));
  EXPECT_NE(error_of([&] { plan("flash", 3, 4096, 1, 0); }).find("does not divide"),
            std::string::npos);
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
  // The device cache holds the MTP state beside the stores (one slot more: the padding rows').
  const int64_t mtp_state = device_mtp_state_bytes(c, p.cache.max_seqs + 1);
  EXPECT_EQ(mtp_state, c.n_mtp_layers > 0 ? (p.cache.max_seqs + 1) * c.hc_mult * c.dim * 2 : 0);
  EXPECT_EQ(p.pools[0].cache, cache_bytes(c, p.cache) + mtp_state);
  EXPECT_EQ(p.pools[0].cache_min, cache_bytes(c, cache_fixed_part(c, 1, 64)) + mtp_state);
  EXPECT_EQ(p.pools[0].speculation, 0);  // no speculation asked
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

// Speculative decoding on one GPU: the rollback's save area and the MTP steps' rows are in the
// plan (and so in what the pool is sized against), as the runner allocates them; nothing on
// the CPU backend's plan or with several ranks (neither speculates on the GPU).
// The sparse attention's predecoded keys of a one-sequence prefill chunk: a 1 KiB BF16 row per
// token, window slot and compressed entry the chunk's last token can see at the finest ratio
// (the rows sparse_attention_predecode.cu writes: T + S (W + (max_position + 1) / ratio), S = 1).
TEST(MemoryPlan, PredecodedKeysOfAPrefillChunk) {
  const std::string data = std::string(DSV4_SOURCE_DIR) + "/tests/data/";
  ModelConfig c = load_model_config(data + "deepseek-v4-flash.config.json");
  const int64_t W = c.window_size, ctx = int64_t(1) << 20;
  EXPECT_EQ(predecoded_keys_bytes(c, 8192, ctx), (8192 + W + ctx / 4) * 1024);  // CSA layers
  // 8192 tokens at 64K fit the split-KV budget the plan always held; at 1M they do not.
  EXPECT_LE(predecoded_keys_bytes(c, 8192, 65536), kAttnSplitWorkspaceBytes);
  EXPECT_GT(predecoded_keys_bytes(c, 8192, ctx), kAttnSplitWorkspaceBytes);
  for (int& r : c.compress_ratios)
    if (r == 4) r = 128;
  EXPECT_EQ(predecoded_keys_bytes(c, 8192, ctx), (8192 + W + ctx / 128) * 1024);  // HCA only
  for (int& r : c.compress_ratios) r = 0;
  EXPECT_EQ(predecoded_keys_bytes(c, 100, ctx), (100 + W) * 1024);  // the window alone
}

TEST(MemoryPlan, SpeculationIsCountedInTheCudaPool) {
  const std::string data = std::string(DSV4_SOURCE_DIR) + "/tests/data/";
  const ModelConfig c = load_model_config(data + "deepseek-v4-flash.config.json");
  ASSERT_GT(c.n_mtp_layers, 0);
  const QuantScheme q = QuantScheme::load(data, c);
  MemoryPlanOptions o;
  o.backend = PlanBackend::kCuda;
  o.max_tokens = 65536;
  o.max_sequences = 8;
  const MemoryPlan plain = plan_memory(c, q, o);
  o.speculative_tokens = 3;
  const MemoryPlan spec = plan_memory(c, q, o);
  const int64_t want = speculation_device_bytes(c, 8, spec.step.tokens, 65536, 64);
  EXPECT_EQ(spec.pools[0].speculation, want);
  EXPECT_EQ(spec.pools[0].planned() - plain.pools[0].planned(), want);
  EXPECT_EQ(spec.pools[0].required() - plain.pools[0].required(), want);
  // The save area: per sequence, k + 1 = 4 window entries in every block, at most two
  // compressed entries (and indexer keys) per compressing block, the compressor states whole
  // or by row; linear in the sequences.
  const RollbackBound one = rollback_bound(c, 1, kMaxDraftTokens + 1, kMaxDraftTokens);
  const RollbackBound eight = rollback_bound(c, 8, kMaxDraftTokens + 1, kMaxDraftTokens);
  EXPECT_EQ(eight.bytes, 8 * one.bytes);
  EXPECT_EQ(eight.segments, 8 * one.segments);
  const int64_t entry = kv_layout(c).entry_bytes();
  EXPECT_GE(one.bytes, int64_t(c.num_blocks()) * 4 * entry);
  std::printf("  V4-Flash: rollback area %.2f MiB per sequence, speculation %.1f MiB at 8 x 64K\n",
              double(one.bytes) / (1 << 20), double(want) / (1 << 20));
  EXPECT_NE(describe_plan(spec).find("speculation"), std::string::npos);
  EXPECT_EQ(describe_plan(plain).find("speculation"), std::string::npos);
  // The CPU backend's plan and several ranks: no GPU speculation buffers.
  MemoryPlanOptions cpu = o;
  cpu.backend = PlanBackend::kCpu;
  EXPECT_EQ(plan_memory(c, q, cpu).pools[0].speculation, 0);
  MemoryPlanOptions two = o;
  two.parallel = {2, 2, 1};
  for (const MemoryPool& m : plan_memory(c, q, two).pools) EXPECT_EQ(m.speculation, 0);
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
