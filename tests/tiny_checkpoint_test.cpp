// dsv4 make-tiny: the golden sets' geometry, the official tensor inventory (the loader's
// inventory check passes), and their conditioning: every residual branch adds about 3 % of
// the stream RMS.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backends/cpu/loader.h"
#include "backends/cpu/runner.h"
#include "model/cache_spec.h"
#include "model/tiny_checkpoint.h"
#include "support/golden.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

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

}  // namespace
}  // namespace dsv4::test
