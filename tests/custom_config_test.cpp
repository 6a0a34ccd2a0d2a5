// Nothing is hard-coded to the released or golden geometries: a model with a CSA layer first,
// one output group, two heads, a 16-token window, top-3 selection, 8 experts (top-2), a
// sigmoid router and no MTP loads, runs, and keeps its path independence bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "backends/cpu/loader.h"
#include "backends/cpu/runner.h"
#include "model/cache_spec.h"
#include "model/tiny_checkpoint.h"
#include "support/custom_config.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

TEST(CustomConfig, RunsAndStaysPathIndependent) {
  TempDir d;
  write_tiny_checkpoint(custom_config(), ExpertFormat::kNvfp4, 9, d.path());
  LoadedModel lm = load_cpu_model(d.path());
  const ModelConfig& c = lm.config;
  EXPECT_EQ(c.window_size, 16);
  EXPECT_EQ(c.compress_ratios, custom_config().compress_ratios);
  const int T = 300, V = c.vocab_size;
  std::mt19937 rng(1);
  std::vector<int32_t> prompt(T);
  for (auto& t : prompt) t = int32_t(rng() % V);
  auto run = [&](int chunk) {
    CpuRunner r(*lm.model, cache_capacity(c, 1, T, 8));
    const int s = r.open_sequence();
    std::vector<float> out;
    for (int i = 0; i < T; i += chunk) {
      const int n = std::min(chunk, T - i);
      std::vector<float> l =
          r.step_logits({{s, {prompt.begin() + i, prompt.begin() + i + n}, true}});
      out.insert(out.end(), l.begin(), l.end());
    }
    return out;
  };
  const std::vector<float> whole = run(T), tbt = run(1), chunked = run(13);
  ASSERT_EQ(whole.size(), size_t(T) * V);
  for (float v : whole) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(std::memcmp(whole.data(), tbt.data(), whole.size() * 4), 0);
  EXPECT_EQ(std::memcmp(whole.data(), chunked.data(), whole.size() * 4), 0);
  // The logits depend on the prompt (a model that ignored its input would pass the above).
  std::vector<int32_t> other = prompt;
  other[T / 2] = (other[T / 2] + 1) % V;
  CpuRunner r(*lm.model, cache_capacity(c, 1, T, 8));
  const int s = r.open_sequence();
  std::vector<float> l = r.step_logits({{s, other, true}});
  EXPECT_EQ(std::memcmp(l.data(), whole.data(), size_t(T / 2) * V * 4), 0);
  EXPECT_NE(
      std::memcmp(l.data() + size_t(T / 2) * V, whole.data() + size_t(T / 2) * V, size_t(V) * 4),
      0);
}

}  // namespace
}  // namespace dsv4::test
