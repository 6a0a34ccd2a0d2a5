// End-to-end agreement with the official reference's logits and greedy tokens, every case of
// every golden set, printed beside the reference's own prefill-vs-token-by-token agreement.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "core/error.h"
#include "runtime/cpu_runner.h"
#include "support/golden.h"

namespace dsv4::test {
namespace {

struct Tolerance {
  double min_cos = 0.999, mean_cos = 0.9999, argmax = 0.97, max_abs = 0.7, greedy_gap = 0.1;
};

class GoldenE2E : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (golden_root().empty()) GTEST_SKIP() << "golden data not found (set DSV4_GOLDEN_DIR)";
  }
};

// Teacher-forced logits of one sequence: prefill `prompt_len` tokens of `tokens`, then decode
// the rest one token at a time. Returns rows for positions 0..tokens.size()-1.
std::vector<float> forced_logits(CpuRunner& r, const std::vector<int32_t>& tokens, int prompt_len) {
  const int seq = r.open_sequence();
  std::vector<float> all = r.step({{seq, {tokens.begin(), tokens.begin() + prompt_len}, true}});
  for (size_t p = prompt_len; p < tokens.size(); ++p) {
    std::vector<float> row = r.step({{seq, {tokens[p]}, false}});
    all.insert(all.end(), row.begin(), row.end());
  }
  r.close_sequence(seq);
  return all;
}

std::vector<int32_t> as_tokens(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

// Picks rows at `positions` out of full per-position logits.
std::vector<float> pick(const std::vector<float>& all, const std::vector<int64_t>& positions, int V) {
  std::vector<float> out;
  for (int64_t p : positions) out.insert(out.end(), all.begin() + p * V, all.begin() + (p + 1) * V);
  return out;
}

// Greedy continuation check: from our logits at each continuation position, argmax must equal
// the golden token unless the golden's own top-2 gap there is < 0.1; compares up to the first
// allowed divergence. Returns a failure message or "".
std::string check_greedy(const std::vector<float>& ours, const std::vector<float>& gold_rows,
                         const std::vector<int64_t>& gold_pos, const std::vector<int32_t>& tokens,
                         int prompt_len, int V, double gap_tol) {
  for (size_t p = prompt_len - 1; p + 1 < tokens.size(); ++p) {
    const float* row = ours.data() + p * V;
    const int32_t mine = static_cast<int32_t>(std::max_element(row, row + V) - row);
    if (mine == tokens[p + 1]) continue;
    auto it = std::find(gold_pos.begin(), gold_pos.end(), int64_t(p));
    if (it == gold_pos.end()) return "";  // no reference logits there: cannot judge further
    const float* g = gold_rows.data() + (it - gold_pos.begin()) * V;
    std::vector<float> s(g, g + V);
    std::partial_sort(s.begin(), s.begin() + 2, s.end(), std::greater<float>());
    if (s[0] - s[1] < gap_tol) return "";  // a near tie: the sequences may part here
    return cat("greedy token at position ", p + 1, ": ours ", mine, ", reference ", tokens[p + 1],
               " (reference top-2 gap ", s[0] - s[1], ")");
  }
  return "";
}

void expect_close(const std::string& what, const LogitStats& s, const Tolerance& t) {
  EXPECT_GE(s.min_cos, t.min_cos) << what;
  EXPECT_GE(s.mean_cos, t.mean_cos) << what;
  EXPECT_GE(s.argmax_agree, t.argmax) << what;
  EXPECT_LE(s.max_abs, t.max_abs) << what;
}

TEST_P(GoldenE2E, LogitsAndGreedyTokens) {
  GoldenSet g(GetParam());
  LoadedModel lm = load_cpu_model(g.checkpoint("mxfp4"));
  const int V = lm.config.vocab_size;
  const Tolerance tol;
  CpuRunner runner(*lm.model, CacheConfig::for_capacity(lm.config, 2, 320, 64));
  nlohmann::json summary = nlohmann::json::parse(std::ifstream(g.dir + "/summary.json"));
  const auto& self = summary["self_agreement_prefill_vs_tbt"]["per_case"];

  LogitStats worst;
  std::vector<float> all_ours, all_gold;
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
    LogitStats s = logit_stats(mine.data(), gold.data(), pos.size(), V);
    const auto& ref = self[k];
    std::printf("[%s] %s prefill: ours %s\n          reference prefill-vs-tbt: min cos %.7f, mean cos %.7f, max|d| %.4f, argmax %.2f%%\n",
                g.name.c_str(), k.c_str(), to_string(s).c_str(), ref["min_cosine"].get<double>(),
                ref["mean_cosine"].get<double>(), ref["max_abs_diff"].get<double>(),
                100 * ref["argmax_agree"].get<double>());
    expect_close(k + " prefill", s, tol);
    std::string greedy = check_greedy(ours, gold, pos, toks, L, V, tol.greedy_gap);
    EXPECT_EQ(greedy, "") << k << " prefill";
    if (L == 300) {
      // Token-by-token mode: every position 0..314 is stored.
      std::vector<int32_t> tt = as_tokens(to_ints(g.get(k + ".tbt.tokens")));
      std::vector<float> ours_t = forced_logits(runner, tt, L);
      std::vector<float> gold_t = to_floats(g.get(k + ".tbt.logits"));
      const size_t rows = gold_t.size() / V;
      LogitStats st = logit_stats(ours_t.data(), gold_t.data(), rows, V);
      std::printf("[%s] %s tbt: ours %s\n", g.name.c_str(), k.c_str(), to_string(st).c_str());
      expect_close(k + " tbt", st, tol);
      std::vector<int64_t> all_pos(rows);
      for (size_t i = 0; i < rows; ++i) all_pos[i] = int64_t(i);
      EXPECT_EQ(check_greedy(ours_t, gold_t, all_pos, tt, L, V, tol.greedy_gap), "") << k << " tbt";
    }
  }

  // The batch: two prompts (150 and 61 tokens) run together, as the reference did: one
  // prefill of the common 61 tokens, then lockstep 1-token steps (each row forced inside its
  // prompt). Our engine gives every row its own chunk; the rows must not affect each other.
  std::vector<int64_t> lens = to_ints(g.get("batch.prompt_lens"));
  std::vector<int64_t> bt = to_ints(g.get("batch.prefill.tokens"));
  const size_t width = bt.size() / 2;
  std::vector<std::vector<int32_t>> rows_tok(2);
  for (int b = 0; b < 2; ++b) rows_tok[b].assign(bt.begin() + b * width, bt.begin() + (b + 1) * width);
  const int common = static_cast<int>(std::min(lens[0], lens[1]));
  const int s0 = runner.open_sequence(), s1 = runner.open_sequence();
  std::vector<float> r0, r1;
  {
    std::vector<float> l = runner.step({{s0, {rows_tok[0].begin(), rows_tok[0].begin() + common}, true},
                                        {s1, {rows_tok[1].begin(), rows_tok[1].begin() + common}, true}});
    r0.assign(l.begin(), l.begin() + size_t(common) * V);
    r1.assign(l.begin() + size_t(common) * V, l.end());
  }
  for (size_t p = common; p < width; ++p) {
    std::vector<float> l = runner.step({{s0, {rows_tok[0][p]}, false}, {s1, {rows_tok[1][p]}, false}});
    r0.insert(r0.end(), l.begin(), l.begin() + V);
    r1.insert(r1.end(), l.begin() + V, l.end());
  }
  runner.close_sequence(s0);
  runner.close_sequence(s1);
  for (int b = 0; b < 2; ++b) {
    const std::string name = "batch.prefill.logits.row" + std::to_string(b);
    std::vector<float> gold = to_floats(g.get(name));
    const size_t rows = gold.size() / V;
    const std::vector<float>& ours = b ? r1 : r0;
    LogitStats s = logit_stats(ours.data(), gold.data(), rows, V);
    const auto& ref = self["batch"]["row" + std::to_string(b)];
    std::printf("[%s] batch row %d: ours %s\n          reference prefill-vs-tbt: min cos %.7f, mean cos %.7f, max|d| %.4f, argmax %.2f%%\n",
                g.name.c_str(), b, to_string(s).c_str(), ref["min_cosine"].get<double>(),
                ref["mean_cosine"].get<double>(), ref["max_abs_diff"].get<double>(),
                100 * ref["argmax_agree"].get<double>());
    expect_close(name, s, tol);
    std::vector<int64_t> pos(rows);
    for (size_t i = 0; i < rows; ++i) pos[i] = int64_t(i);
    EXPECT_EQ(check_greedy(ours, gold, pos, rows_tok[b], int(lens[b]), V, tol.greedy_gap), "") << name;
    // Token-by-token batch logits (positions 0..60 of both rows).
    std::vector<float> gt = to_floats(g.get("batch.tbt.logits"));
    const size_t trows = gt.size() / V / 2;
    LogitStats st = logit_stats(ours.data(), gt.data() + b * trows * V, trows, V);
    std::printf("[%s] batch row %d tbt: ours %s\n", g.name.c_str(), b, to_string(st).c_str());
    expect_close(name + " vs tbt", st, tol);
  }
}

INSTANTIATE_TEST_SUITE_P(Sets, GoldenE2E, ::testing::ValuesIn(golden_sets().empty()
                                               ? std::vector<std::string>{"none"}
                                               : golden_sets()));

}  // namespace
}  // namespace dsv4::test
