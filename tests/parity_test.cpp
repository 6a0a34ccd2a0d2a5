// Path independence of the CPU backend, bit for bit: one prefill = token-by-token decode =
// chunked prefill at odd chunk sizes, for prompt lengths at every residue that matters
// (mod 4, mod 128, the window edges); a sequence's logits do not depend on its batchmates;
// the cache page size changes nothing, logits or cache bytes. On make-tiny checkpoints of
// both presets (no golden data needed).
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "backends/cpu/cache_io.h"
#include "backends/cpu/loader.h"
#include "backends/cpu/runner.h"
#include "core/error.h"
#include "model/cache_spec.h"
#include "model/tiny_checkpoint.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

constexpr int kLen = 300;
const std::vector<int> kLengths = {1,   2,   3,   4,   5,   6,   7,   8,   9,   126,
                                   127, 128, 129, 130, 131, 255, 256, 257, 258, 300};

struct Preset {
  TempDir dir;
  LoadedModel lm;
  std::vector<int32_t> prompt;
  std::vector<float> tbt;  // token-by-token logits of `prompt`, [kLen, vocab]

  explicit Preset(const std::string& name) {
    write_tiny_checkpoint(tiny_preset(name), ExpertFormat::kMxfp4, 42, dir.path(), tiny_init(name));
    lm = load_cpu_model(dir.path());
    std::mt19937 rng(7);
    prompt.push_back(lm.config.bos_token_id);
    while (prompt.size() < kLen) prompt.push_back(2 + int32_t(rng() % (lm.config.vocab_size - 2)));
    CpuRunner r = runner(64);
    const int s = r.open_sequence();
    for (int p = 0; p < kLen; ++p) {
      std::vector<float> row = r.step_logits({{s, {prompt[p]}, true}});
      tbt.insert(tbt.end(), row.begin(), row.end());
    }
  }
  CpuRunner runner(int page, int seqs = 4) const {
    return CpuRunner(*lm.model, cache_capacity(lm.config, seqs, kLen, page));
  }
  int V() const { return lm.config.vocab_size; }
  // Logits of `prompt[:len]` fed in chunks of `chunk` (0 = one prefill).
  std::vector<float> chunked(CpuRunner& r, int len, int chunk) const {
    const int s = r.open_sequence();
    std::vector<float> out;
    const int step = chunk ? chunk : len;
    for (int i = 0; i < len; i += step) {
      const int n = std::min(step, len - i);
      std::vector<float> l =
          r.step_logits({{s, {prompt.begin() + i, prompt.begin() + i + n}, true}});
      out.insert(out.end(), l.begin(), l.end());
    }
    r.close_sequence(s);
    return out;
  }
  // First row index where `a` and the token-by-token logits differ (-1 if bit-identical).
  int first_diff(const std::vector<float>& a) const {
    for (size_t r = 0; r < a.size() / V(); ++r)
      if (std::memcmp(a.data() + r * V(), tbt.data() + r * V(), V() * sizeof(float)) != 0)
        return int(r);
    return -1;
  }
};

class Parity : public ::testing::TestWithParam<std::string> {
 protected:
  static std::map<std::string, std::unique_ptr<Preset>>& presets() {
    static std::map<std::string, std::unique_ptr<Preset>> p;
    return p;
  }
  const Preset& preset() {
    auto& p = presets()[GetParam()];
    if (!p) p = std::make_unique<Preset>(GetParam());
    return *p;
  }
};

TEST_P(Parity, OnePrefillEqualsTokenByToken) {
  const Preset& p = preset();
  CpuRunner r = p.runner(64);
  for (int len : kLengths)
    EXPECT_EQ(p.first_diff(p.chunked(r, len, 0)), -1) << "prefill of " << len << " tokens";
}

TEST_P(Parity, ChunkedPrefillEqualsTokenByToken) {
  const Preset& p = preset();
  CpuRunner r = p.runner(64);
  // Odd chunk sizes against lengths that end on either side of the 4- and 128-boundaries.
  const std::pair<int, int> runs[] = {{5, 3},     {9, 7},   {127, 3},  {131, 7},
                                      {255, 129}, {258, 7}, {300, 129}};
  for (auto [len, chunk] : runs)
    EXPECT_EQ(p.first_diff(p.chunked(r, len, chunk)), -1)
        << len << " tokens in chunks of " << chunk;
  // Chunks of growing size put a chunk boundary at many residues mod 4 and mod 128.
  const int s = r.open_sequence();
  std::vector<float> out;
  for (int i = 0, n = 1; i < kLen; i += n, ++n) {
    const int m = std::min(n, kLen - i);
    std::vector<float> l =
        r.step_logits({{s, {p.prompt.begin() + i, p.prompt.begin() + i + m}, true}});
    out.insert(out.end(), l.begin(), l.end());
  }
  EXPECT_EQ(p.first_diff(out), -1) << "growing chunks";
}

TEST_P(Parity, BatchmatesDoNotMatter) {
  const Preset& p = preset();
  const int V = p.V();
  CpuRunner r = p.runner(64);
  // Sequence A decodes while B and C prefill, then all three continue together.
  const int a = r.open_sequence(), b = r.open_sequence(), c = r.open_sequence();
  std::vector<float> la = r.step_logits({{a, {p.prompt.begin(), p.prompt.begin() + 130}, true}});
  std::vector<float> lb, lc;
  std::mt19937 rng(9);
  std::vector<int32_t> other(kLen);
  for (auto& t : other) t = int32_t(rng() % V);
  int pa = 130, pb = 0, pc = 0;
  while (pa < kLen) {
    std::vector<StepInput> in{{a, {p.prompt[pa]}, true}};
    const int nb = std::min(37, kLen - pb), nc = pc < 9 ? 9 : 1;
    if (nb > 0) in.push_back({b, {other.begin() + pb, other.begin() + pb + nb}, false});
    if (pc + nc <= kLen)
      in.push_back({c, {p.prompt.begin() + pc, p.prompt.begin() + pc + nc}, true});
    std::vector<float> l = r.step_logits(in);
    la.insert(la.end(), l.begin(), l.begin() + V);
    if (pc + nc <= kLen) lc.insert(lc.end(), l.end() - size_t(nc) * V, l.end());
    ++pa;
    pb += std::max(nb, 0);
    pc += nc;
  }
  EXPECT_EQ(p.first_diff(la), -1) << "sequence A";
  EXPECT_EQ(p.first_diff(lc), -1) << "sequence C (same prompt, different batchmates and chunks)";
}

TEST_P(Parity, PageSizeChangesNothing) {
  const Preset& p = preset();
  const ModelConfig& c = p.lm.config;
  std::vector<std::vector<float>> stores;
  for (int page : {16, 256}) {  // the token-by-token reference ran with 64
    CpuRunner r = p.runner(page, 1);
    const int s = r.open_sequence();
    std::vector<float> l = r.step_logits({{s, p.prompt, true}});
    EXPECT_EQ(p.first_diff(l), -1) << "page size " << page;
    std::vector<float> all;
    for (int k = 0; k < c.n_layers; ++k) {
      auto w = read_window(r.cache(), k, r.sequence(s));
      all.insert(all.end(), w.begin(), w.end());
      if (c.ratio(k)) {
        auto v = read_compressed(r.cache(), k, r.sequence(s), kLen / c.ratio(k));
        all.insert(all.end(), v.begin(), v.end());
      }
      if (c.ratio(k) == 4) {
        auto v = read_index_keys(r.cache(), k, r.sequence(s), kLen / 4);
        all.insert(all.end(), v.begin(), v.end());
      }
    }
    stores.push_back(std::move(all));
  }
  EXPECT_EQ(stores[0], stores[1]);
}

TEST_P(Parity, CacheFullIsAClearError) {
  const Preset& p = preset();
  CpuRunner r(*p.lm.model, cache_capacity(p.lm.config, 1, 64, 16));
  const int s = r.open_sequence();
  try {
    r.step_logits({{s, p.prompt, false}});
    FAIL() << "expected the cache to run out";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cache full"), std::string::npos) << e.what();
  }
  EXPECT_EQ(r.length(s), 0);               // nothing was run
  EXPECT_THROW(r.open_sequence(), Error);  // one sequence slot only
  EXPECT_THROW(r.step_logits({{s, {int32_t(p.lm.config.vocab_size)}, false}}), Error);
  EXPECT_THROW(r.step_logits({{s, {}, false}}), Error);
  EXPECT_THROW(r.step_logits({{s, {1}, false}, {s, {2}, false}}), Error);
}

INSTANTIATE_TEST_SUITE_P(Presets, Parity, ::testing::Values("flash", "pro"));

}  // namespace
}  // namespace dsv4::test
