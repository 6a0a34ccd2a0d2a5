// dsv4 make-tiny: the golden sets' geometry, the official tensor inventory (the loader's
// inventory check passes), and their conditioning: every residual branch adds about 3 % of
// the stream RMS.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>

#include "backends/cpu/loader.h"
#include "backends/cpu/runner.h"
#include "core/error.h"
#include "dsv4/engine.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "io/tensor_store.h"
#include "model/cache_spec.h"
#include "model/model_source.h"
#include "model/tiny_checkpoint.h"
#include "support/golden.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

double rms(const float* x, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += double(x[i]) * x[i];
  return std::sqrt(s / n);
}

class TinyPreset : public ::testing::TestWithParam<std::string> {};

TEST_P(TinyPreset, MatchesGoldenGeometry) {
  const ModelConfig c = tiny_preset(GetParam());
  const std::string golden = golden_root();
  if (golden.empty())
    GTEST_SKIP() << "golden data not found: geometry compared to the golden config";
  const ModelConfig g = load_model_config(golden + "/tiny-" + GetParam() + "/hf-mxfp4/config.json");
  EXPECT_EQ(c.vocab_size, g.vocab_size);
  EXPECT_EQ(c.dim, g.dim);
  EXPECT_EQ(c.n_layers, g.n_layers);
  EXPECT_EQ(c.compress_ratios, g.compress_ratios);
  EXPECT_EQ(c.n_hash_layers, g.n_hash_layers);
  EXPECT_EQ(c.n_heads, g.n_heads);
  EXPECT_EQ(c.head_dim, g.head_dim);
  EXPECT_EQ(c.q_lora_rank, g.q_lora_rank);
  EXPECT_EQ(c.o_groups, g.o_groups);
  EXPECT_EQ(c.o_lora_rank, g.o_lora_rank);
  EXPECT_EQ(c.index_n_heads, g.index_n_heads);
  EXPECT_EQ(c.index_topk, g.index_topk);
  EXPECT_EQ(c.n_routed_experts, g.n_routed_experts);
  EXPECT_EQ(c.n_activated_experts, g.n_activated_experts);
  EXPECT_EQ(c.moe_inter_dim, g.moe_inter_dim);
  EXPECT_EQ(c.route_scale, g.route_scale);
  EXPECT_EQ(c.window_size, g.window_size);
  EXPECT_EQ(c.compress_rope_theta, g.compress_rope_theta);
  EXPECT_EQ(c.original_seq_len, g.original_seq_len);
}

TEST_P(TinyPreset, BranchesAddAboutThreePercent) {
  for (ExpertFormat f : {ExpertFormat::kMxfp4, ExpertFormat::kNvfp4}) {
    TempDir d;
    write_tiny_checkpoint(tiny_preset(GetParam()), f, 11, d.path(), tiny_init(GetParam()));
    LoadedModel lm = load_cpu_model(d.path());  // inventory, dtypes and shapes check out
    const ModelConfig& c = lm.config;
    std::mt19937 rng(3);
    std::vector<int32_t> prompt{0};
    while (prompt.size() < 160) prompt.push_back(2 + int32_t(rng() % (c.vocab_size - 2)));
    CpuRunner r(*lm.model, cache_capacity(c, 1, 160, 64));
    RecordingTrace tr;
    const int s = r.open_sequence();
    std::vector<float> logits = r.step_traced({{s, prompt, true}}, &tr).logits;
    double attn = 0, ffn = 0;
    for (int k = 0; k < c.n_layers; ++k) {
      const auto& in = tr.f(k, 0, "hidden.in");
      const double stream = rms(in.data(), in.size());
      attn += rms(tr.f(k, 0, "attn_out").data(), tr.f(k, 0, "attn_out").size()) / stream;
      ffn += rms(tr.f(k, 0, "ffn_out").data(), tr.f(k, 0, "ffn_out").size()) / stream;
    }
    attn /= c.n_layers, ffn /= c.n_layers;
    double sd = 0;
    for (float v : logits) sd += double(v) * v;
    sd = std::sqrt(sd / logits.size());
    std::printf("[%s %s] branch RMS / stream RMS: attention %.4f, MoE %.4f; logit RMS %.2f\n",
                GetParam().c_str(), expert_format_name(f), attn, ffn, sd);
    EXPECT_GT(attn, 0.015);
    EXPECT_LT(attn, 0.06);
    EXPECT_GT(ffn, 0.015);
    EXPECT_LT(ffn, 0.06);
    EXPECT_GT(sd, 1.0);  // logits spread like the golden sets' (std about 3-4)
    EXPECT_LT(sd, 10.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, TinyPreset, ::testing::Values("flash", "pro"));

TEST(FirstLayers, KeepsTheShapesAndTheFirstRatiosWithoutMtp) {
  const ModelConfig c = tiny_preset("pro");  // ratios {128, 128, 4, 128, 4 | MTP 0}, 3 hash
  const ModelConfig f = first_layers(c, 2);
  EXPECT_EQ(f.n_layers, 2);
  EXPECT_EQ(f.n_mtp_layers, 0);
  EXPECT_EQ(f.compress_ratios, (std::vector<int>{128, 128}));
  EXPECT_EQ(f.n_hash_layers, 2);  // no more hash layers than layers
  EXPECT_EQ(f.dim, c.dim);
  EXPECT_EQ(f.n_routed_experts, c.n_routed_experts);
  EXPECT_EQ(first_layers(c, 5).compress_ratios, (std::vector<int>{128, 128, 4, 128, 4}));
  EXPECT_THROW(first_layers(c, 0), Error);
  EXPECT_THROW(first_layers(c, 6), Error);
}

// repeat_experts: every routed expert of a block is expert 0's bytes (NVFP4: with the scales
// and ModelOpt's per-module entries), other tensors stay distinct draws, and it loads.
TEST(RepeatExperts, EveryExpertOfABlockIsTheFirstOnesDraw) {
  for (ExpertFormat fmt : {ExpertFormat::kMxfp4, ExpertFormat::kNvfp4}) {
    TempDir d;
    TinyInit init = tiny_init("flash");
    init.repeat_experts = true;
    const ModelConfig c = first_layers(tiny_preset("flash"), 3);
    write_tiny_checkpoint(c, fmt, 5, d.path(), init);
    LoadedModel lm = load_cpu_model(d.path());  // inventory, dtypes and shapes check out
    std::map<std::string, std::unique_ptr<SafetensorsFile>> files;
    std::map<std::string, const TensorView*> all;
    for (const auto& e : std::filesystem::directory_iterator(d.path())) {
      if (e.path().extension() != ".safetensors") continue;
      auto f = std::make_unique<SafetensorsFile>(e.path().string());
      for (const auto& [name, t] : f->tensors()) all[name] = &t;
      files[e.path().string()] = std::move(f);
    }
    auto bytes = [&](const std::string& n) {
      const TensorView* t = all.at(n);
      return std::vector<uint8_t>(t->data, t->data + t->nbytes);
    };
    int compared = 0;
    for (int b = 0; b < c.n_layers; ++b) {
      const std::string p = cat("layers.", b, ".ffn.experts.");
      for (const auto& [name, t] : all) {
        if (name.rfind(p + "0.", 0) != 0) continue;
        const std::string rest = name.substr(p.size() + 2);
        for (int e = 1; e < c.n_routed_experts; ++e) {
          ASSERT_EQ(bytes(cat(p, e, ".", rest)), bytes(name)) << name << " expert " << e;
          ++compared;
        }
      }
      if (b > 0) {  // a new draw per block
        EXPECT_NE(bytes(p + "0.w1.weight"),
                  bytes(cat("layers.", b - 1, ".ffn.experts.0.w1.weight")));
      }
    }
    EXPECT_EQ(compared, c.n_layers * (c.n_routed_experts - 1) *
                            (fmt == ExpertFormat::kNvfp4 ? 12 : 6));  // tensors per expert
    EXPECT_NE(bytes("layers.0.attn.wq_a.weight"), bytes("layers.1.attn.wq_a.weight"));
    if (fmt == ExpertFormat::kNvfp4) {
      const std::string q = read_text(d.path() + "/hf_quant_config.json");
      EXPECT_NE(q.find(cat("layers.2.ffn.experts.", c.n_routed_experts - 1, ".w2")),
                std::string::npos);
    }
  }
}

// Random weights in memory (make_tiny_model, EngineOptions::random_weights): the tensors
// write_tiny_checkpoint writes, bit for bit, under the same names, dtypes and shapes, the same
// config; and the CPU engine's logits on them are those of the checkpoint loaded from disk.
struct InMemoryCase {
  std::string preset;
  ExpertFormat format;
};

class InMemory : public ::testing::TestWithParam<InMemoryCase> {};

TEST_P(InMemory, BitIdenticalLogitsToTheCheckpointOnDisk) {
  const auto& [preset, format] = GetParam();
  TempDir d;
  write_tiny_checkpoint(tiny_preset(preset), format, 7, d.path(), tiny_init(preset));
  EngineOptions from_disk;
  from_disk.model_dir = d.path();
  from_disk.max_tokens = 16;
  EngineOptions in_memory = from_disk;
  in_memory.model_dir.clear();
  in_memory.random_weights.preset = preset;
  in_memory.random_weights.format = format == ExpertFormat::kNvfp4 ? "nvfp4" : "mxfp4";
  in_memory.random_weights.seed = 7;
  const std::vector<int32_t> prompt{0, 17, 42, 99, 5, 1000, 3};
  const std::vector<float> a = Engine::open(from_disk)->prompt_logits(prompt);
  const std::vector<float> b = Engine::open(in_memory)->prompt_logits(prompt);
  ASSERT_EQ(a.size(), prompt.size() * size_t(tiny_preset(preset).vocab_size));
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(PresetsAndFormats, InMemory,
                         ::testing::Values(InMemoryCase{"flash", ExpertFormat::kMxfp4},
                                           InMemoryCase{"flash", ExpertFormat::kNvfp4},
                                           InMemoryCase{"pro", ExpertFormat::kMxfp4},
                                           InMemoryCase{"pro", ExpertFormat::kNvfp4}),
                         [](const auto& info) {
                           return info.param.preset + "_" +
                                  (info.param.format == ExpertFormat::kNvfp4 ? "nvfp4" : "mxfp4");
                         });

// Every tensor (MTP block's included, which prompt logits do not read) and the config.
TEST(InMemory, SameTensorsAndConfigAsTheFiles) {
  for (ExpertFormat format : {ExpertFormat::kMxfp4, ExpertFormat::kNvfp4}) {
    TempDir d;
    write_tiny_checkpoint(tiny_preset("flash"), format, 7, d.path(), tiny_init("flash"));
    const Checkpoint disk(d.path());
    const TinyModel m = make_tiny_model(tiny_preset("flash"), format, 7, tiny_init("flash"));
    const Checkpoint mem("random weights", m.tensors);
    EXPECT_EQ(mem.names(), disk.names());
    for (const std::string& n : disk.names()) {
      const TensorView &a = disk.get(n), &b = mem.get(n);
      ASSERT_EQ(a.dtype, b.dtype) << n;
      ASSERT_EQ(a.shape, b.shape) << n;
      ASSERT_EQ(a.nbytes, b.nbytes) << n;
      ASSERT_EQ(std::memcmp(a.data, b.data, a.nbytes), 0) << n;
    }
    EXPECT_EQ(m.tensors->owned_bytes(), m.tensors->view_bytes());  // no aliases
    EXPECT_EQ(model_config_to_json(m.config),
              model_config_to_json(load_model_config(d.path() + "/config.json")));
    EXPECT_EQ(m.scheme.expert_format("layers.0.ffn.experts.3.w2"), format);
    EXPECT_EQ(m.scheme.expert_format("mtp.0.ffn.experts.15.w1"), format);
  }
}

// repeat_experts in memory: the routed experts e > 0 of a block view expert 0's bytes, so the
// store holds the dense weights and one expert per block; the views are the files' tensors.
TEST(InMemory, RepeatedExpertsAreHeldOncePerBlock) {
  for (ExpertFormat fmt : {ExpertFormat::kMxfp4, ExpertFormat::kNvfp4}) {
    TinyInit init = tiny_init("flash");
    init.repeat_experts = true;
    const ModelConfig c = first_layers(tiny_preset("flash"), 3);
    TempDir d;
    write_tiny_checkpoint(c, fmt, 5, d.path(), init);
    const Checkpoint disk(d.path());
    const TinyModel m = make_tiny_model(c, fmt, 5, init);
    const TensorStore& store = *m.tensors;
    size_t disk_bytes = 0, expert0 = 0;
    for (const std::string& n : disk.names()) {
      const TensorView &a = disk.get(n), &b = store.tensors().at(n);
      ASSERT_EQ(a.nbytes, b.nbytes) << n;
      ASSERT_EQ(std::memcmp(a.data, b.data, a.nbytes), 0) << n;
      disk_bytes += a.nbytes;
      if (n.find(".ffn.experts.0.") != std::string::npos) expert0 += a.nbytes;
    }
    ASSERT_GT(expert0, 0u);
    EXPECT_EQ(store.view_bytes(), disk_bytes);
    // Experts 1..E-1 of each block are not held: (E - 1) x one expert's bytes per block less.
    EXPECT_EQ(store.owned_bytes(), disk_bytes - size_t(c.n_routed_experts - 1) * expert0);
    for (int b = 0; b < c.n_layers; ++b)
      for (int e : {1, c.n_routed_experts - 1})
        EXPECT_EQ(store.tensors().at(cat("layers.", b, ".ffn.experts.", e, ".w2.weight")).data,
                  store.tensors().at(cat("layers.", b, ".ffn.experts.0.w2.weight")).data);
    // The dry-run count `dsv4 plan --random-weights` prints is the store's.
    RandomWeights r;
    r.preset = "flash";
    r.format = fmt;
    r.layers = 3;
    r.repeat_experts = true;
    EXPECT_EQ(random_weights_bytes(r), int64_t(store.owned_bytes()));
    r.repeat_experts = false;
    EXPECT_EQ(random_weights_bytes(r), int64_t(disk_bytes));
  }
}

TEST(InMemory, StoreAndEngineRefuseWhatIsWrong) {
  TensorStore s;
  s.add("a", DType::kF32, {2}, std::vector<uint8_t>(8));
  EXPECT_THROW(s.add("a", DType::kF32, {2}, std::vector<uint8_t>(8)), Error);  // duplicate
  EXPECT_THROW(s.add("b", DType::kF32, {3}, std::vector<uint8_t>(8)), Error);  // 12 bytes due
  EXPECT_THROW(s.alias("c", "nothing"), Error);
  s.alias("c", "a");
  EXPECT_THROW(s.alias("c", "a"), Error);
  EXPECT_EQ(s.owned_bytes(), 8u);
  EXPECT_EQ(s.view_bytes(), 16u);
  auto store = std::make_shared<TensorStore>(std::move(s));
  const Checkpoint ck("random weights (test)", store);
  EXPECT_EQ(ck.get("c").data, ck.get("a").data);
  try {
    ck.get("missing");
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("random weights (test): checkpoint has no tensor"),
              std::string::npos)
        << e.what();
  }

  auto expect_error = [](const EngineOptions& o, const std::string& want) {
    try {
      Engine::open(o);
      ADD_FAILURE() << "no throw, want " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  TempDir d;
  EngineOptions both;
  both.model_dir = d.path();
  both.random_weights.preset = "flash";
  expect_error(both, "give either a model directory");
  expect_error(EngineOptions{}, "no model: give a model directory or random weights");
  EngineOptions bad;
  bad.random_weights.preset = "huge";
  expect_error(bad, "'huge' is neither a preset (flash, pro) nor a config.json file");
  bad.random_weights.preset = "pro";
  bad.random_weights.format = "int3";
  expect_error(bad, "format 'int3' is not one of mxfp4, nvfp4");
  bad.random_weights.format = "nvfp4";
  bad.random_weights.layers = 9;
  expect_error(bad, "layers must be in [1, 5]");
}

}  // namespace
}  // namespace dsv4::test
