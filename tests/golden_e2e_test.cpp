// End-to-end agreement with the official reference's logits and greedy tokens, every case of
// every golden set, printed beside the reference's own prefill-vs-token-by-token agreement.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "backends/cpu/runner.h"
#include "core/error.h"
#include "model/cache_spec.h"
#include "support/golden.h"

namespace dsv4::test {
namespace {

// The golden README's suggested acceptance (E2eTolerance, support/golden.h). A "near tie" is a
// row whose reference top-2 logit gap is below `near_tie`: max(0.1, the reference's own largest
// prefill-vs-token-by-token logit difference on the set, from summary.json). These tiny random
// models move logits by up to 0.3 for a single BF16 ulp anywhere (README), so an argmax that flips
// at such a gap is within the reference's own evaluation-order noise; argmax agreement counts those
// rows as excused, and greedy continuations may part there. Raw agreement is printed and the raw
// figure over all rows of a set must still reach 97 %.
class GoldenE2E : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (golden_root().empty()) GTEST_SKIP() << "golden data not found (set DSV4_GOLDEN_DIR)";
  }
};

TEST_P(GoldenE2E, LogitsAndGreedyTokens) {
  GoldenSet g(GetParam());
  LoadedModel lm = load_cpu_model(g.checkpoint("mxfp4"));
  const int V = lm.config.vocab_size;
  CpuRunner runner(*lm.model, cache_capacity(lm.config, 2, 320, 64));
  nlohmann::json summary = nlohmann::json::parse(std::ifstream(g.dir + "/summary.json"));
  const auto& self = summary["self_agreement_prefill_vs_tbt"]["per_case"];
  E2eChecker chk;
  chk.t.near_tie =
      std::max(0.1, summary["self_agreement_prefill_vs_tbt"]["ALL"]["max_abs_diff"].get<double>());
  const E2eTolerance& tol = chk.t;
  std::printf("[%s] near-tie gap %.3f\n", g.name.c_str(), tol.near_tie);
  auto print_ref = [&](const nlohmann::json& ref) {
    std::printf("    %-28s min cos %.7f, mean cos %.7f, max|d| %.4f, argmax %.2f%%\n",
                "reference prefill-vs-tbt", ref["min_cosine"].get<double>(),
                ref["mean_cosine"].get<double>(), ref["max_abs_diff"].get<double>(),
                100 * ref["argmax_agree"].get<double>());
  };
  for (int L : {1, 4, 5, 127, 129, 257, 300}) {
    char key[16];
    std::snprintf(key, sizeof key, "len%04d", L);
    const std::string k = key;
    // Prefill mode: the reference's prompt + greedy tokens, teacher-forced.
    std::vector<int32_t> toks = as_tokens(to_ints(g.get(k + ".prefill.tokens")));
    std::vector<float> ours = forced_logits(runner, toks, L);
    std::vector<int64_t> pos = to_ints(g.get(k + ".prefill.positions"));
    std::vector<float> gold = to_floats(g.get(k + ".prefill.logits"));
    std::vector<float> mine = pick(ours, pos, V);
    std::printf("[%s] %s\n", g.name.c_str(), k.c_str());
    chk.check("prefill mode", mine.data(), gold.data(), pos.size(), V);
    print_ref(self[k]);
    EXPECT_EQ(check_greedy(ours, gold, pos, toks, L, V, tol.near_tie), "") << k << " prefill";
    if (L == 300) {
      // Token-by-token mode: every position 0..314 is stored.
      std::vector<int32_t> tt = as_tokens(to_ints(g.get(k + ".tbt.tokens")));
      std::vector<float> ours_t = forced_logits(runner, tt, L);
      std::vector<float> gold_t = to_floats(g.get(k + ".tbt.logits"));
      const size_t rows = gold_t.size() / V;
      chk.check("token-by-token mode", ours_t.data(), gold_t.data(), rows, V);
      std::vector<int64_t> all_pos(rows);
      for (size_t i = 0; i < rows; ++i) all_pos[i] = int64_t(i);
      EXPECT_EQ(check_greedy(ours_t, gold_t, all_pos, tt, L, V, tol.near_tie), "") << k << " tbt";
    }
  }

  // The batch: two prompts (150 and 61 tokens) run together, as the reference did: one
  // prefill of the common 61 tokens, then lockstep 1-token steps (each row forced inside its
  // prompt). Our engine gives every row its own chunk; the rows must not affect each other.
  const GoldenBatch batch = golden_batch(g);
  const std::vector<std::vector<float>> batch_rows = batch_logits(runner, batch, V);

  for (int b = 0; b < 2; ++b) {
    const std::string name = "batch.prefill.logits.row" + std::to_string(b);
    std::vector<float> gold = to_floats(g.get(name));
    const size_t rows = gold.size() / V;
    const std::vector<float>& ours = batch_rows[b];
    std::printf("[%s] batch row %d\n", g.name.c_str(), b);
    chk.check("prefill mode", ours.data(), gold.data(), rows, V);
    print_ref(self["batch"]["row" + std::to_string(b)]);
    std::vector<int64_t> pos(rows);
    for (size_t i = 0; i < rows; ++i) pos[i] = int64_t(i);
    EXPECT_EQ(check_greedy(ours, gold, pos, batch.rows[b], int(batch.lens[b]), V, tol.near_tie), "")
        << name;
    // Token-by-token batch logits (positions 0..60 of both rows).
    std::vector<float> gt = to_floats(g.get("batch.tbt.logits"));
    const size_t trows = gt.size() / V / 2;
    chk.check("token-by-token mode", ours.data(), gt.data() + b * trows * V, trows, V);
  }
  const double raw = double(chk.agree) / double(chk.rows);
  std::printf("[%s] raw argmax agreement over all %zu rows: %.2f%%\n", g.name.c_str(), chk.rows,
              100 * raw);
  EXPECT_GE(raw, tol.argmax);
}

INSTANTIATE_TEST_SUITE_P(Sets, GoldenE2E,
                         ::testing::ValuesIn(golden_sets().empty()
                                                 ? std::vector<std::string>{"none"}
                                                 : golden_sets()));

}  // namespace
}  // namespace dsv4::test
