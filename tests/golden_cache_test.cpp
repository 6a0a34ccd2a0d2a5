// Cache contents against the reference's stored caches (prefill0300.cache): every store of
// every layer, read back from our byte layouts.
//
// A store is a deterministic function of its layer's attention inputs, and the reference's
// own prefill and token-by-token runs already disagree on those inputs beyond the first
// layer (their caches share no window slot at layers >= 2; these tiny models turn one ulp
// into visible differences). So the element-exact check (>= 99.9 % equal, the rest one
// e4m3/e2m1 step or one BF16 ulp apart) is made where the inputs are the reference's:
// * the first layer's stores after our own full 300-token prefill (its inputs are the
//   embeddings, identical), and
// * every layer's compressed entries and indexer keys of the first 128 positions, computed
//   from the reference's stored attention inputs (prefill0129.attn_in).
// Our free-running prefill's stores of deeper layers are compared and printed as well, with a
// bound that catches a wrong store (a missing RoPE, a shifted entry, a wrong quantisation).
// The first layer's window matching bit for bit is also what shows our KV holds real e4m3
// values as the primary goldens do, not the official code's no-op FP8 simulation (README
// quirk 1): the literal variant's BF16 KV would differ in most NoPE elements.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "backends/cpu/cache_io.h"
#include "backends/cpu/runner.h"
#include "model/cache_spec.h"
#include "support/golden.h"
#include "support/golden_cache.h"

namespace dsv4::test {
namespace {

class GoldenCache : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (golden_root().empty()) GTEST_SKIP() << "golden data not found (set DSV4_GOLDEN_DIR)";
  }
};

std::string key(int k, const std::string& what) {
  return "prefill0300.cache.L" + std::to_string(k) + "." + what;
}

TEST_P(GoldenCache, AfterOwnPrefill300) {
  GoldenSet g(GetParam());
  LoadedModel lm = load_cpu_model(g.checkpoint("mxfp4"));
  const ModelConfig& c = lm.config;
  const int T = 300;
  CpuRunner r(*lm.model, cache_capacity(c, 1, T, 64));
  const int s = r.open_sequence();
  r.step_logits(
      {{s, std::vector<int32_t>(g.master_prompt.begin(), g.master_prompt.begin() + T), false}});
  SequenceCache& seq = r.sequence(s);
  for (int k = 0; k < c.n_layers; ++k) {
    SCOPED_TRACE(g.name + " L" + std::to_string(k));
    const bool exact_inputs = k == 0;  // embeddings in, nothing upstream
    auto check_kv = [&](const char* what, const std::vector<float>& ours, bool window, int n) {
      const std::vector<float> ref = to_floats(g.get(key(k, what)));
      const Diff d = compare(ours, ref);
      const StepCheck st = kv_steps(r.cache(), k, seq, n, window, ref);
      std::printf("[%s] L%d %-22s %s, beyond one step %zu\n", g.name.c_str(), k, what,
                  to_string(d).c_str(), st.beyond_one_step);
      if (exact_inputs) {
        EXPECT_GE(st.frac_equal, 0.999) << what;
        EXPECT_EQ(st.beyond_one_step, 0u) << what;
      } else {
        EXPECT_LE(d.rel_l2, 5e-2) << what;
      }
    };
    check_kv("window", read_window(r.cache(), k, seq), true, c.window_size);
    const int ratio = c.ratio(k);
    if (ratio == 0) continue;
    check_kv("compressed", read_compressed(r.cache(), k, seq, T / ratio), false, T / ratio);
    // Compressor states, on the rows the golden marks valid: ratio 4 keeps the last complete
    // block (rows 0..3) and the written rows of the current one; 300 % 4 == 0 leaves none.
    for (bool indexer : {false, true}) {
      if (indexer && ratio != 4) continue;
      const std::string base = indexer ? "indexer.compressor." : "compressor.";
      std::vector<float> kv = state_kv(r.cache(), k, indexer, seq.state_slot, T);
      std::vector<float> sc = state_score(r.cache(), k, indexer, seq.state_slot, T);
      std::vector<float> gkv = to_floats(g.get(key(k, base + "kv_state")));
      std::vector<float> gsc = to_floats(g.get(key(k, base + "score_state")));
      if (ratio == 4) {
        const size_t valid = size_t(4 + T % 4) * (kv.size() / 8);
        kv.resize(valid), sc.resize(valid), gkv.resize(valid), gsc.resize(valid);
      }
      const Diff dk = compare(kv, gkv), ds = compare(sc, gsc);
      std::printf("[%s] L%d %-22s kv %s\n%34s score relL2 %.3g\n", g.name.c_str(), k,
                  (base + "state").c_str(), to_string(dk).c_str(), "", ds.rel_l2);
      EXPECT_LE(dk.rel_l2, exact_inputs ? 1e-5 : 1e-2);
      EXPECT_LE(ds.rel_l2, exact_inputs ? 1e-5 : 1e-2);
    }
    if (ratio == 4) {
      const std::vector<float> ours = read_index_keys(r.cache(), k, seq, T / 4);
      const std::vector<float> ref = to_floats(g.get(key(k, "indexer.keys")));
      const StepCheck st = key_steps(r.cache(), k, seq, T / 4, ref);
      std::printf("[%s] L%d %-22s %s\n", g.name.c_str(), k, "indexer.keys",
                  to_string(compare(ours, ref)).c_str());
      if (exact_inputs)
        EXPECT_GE(st.frac_equal, 0.999);
      else
        EXPECT_LE(compare(ours, ref).rel_l2, 1e-1);
    }
  }
}

TEST_P(GoldenCache, CompressedEntriesFromStoredInputs) {
  GoldenSet g(GetParam());
  LoadedModel lm = load_cpu_model(g.checkpoint("mxfp4"));
  const ModelConfig& c = lm.config;
  const int T = 129, D = c.head_dim, dim = c.dim;
  (void)D;
  std::vector<int32_t> tokens(g.master_prompt.begin(), g.master_prompt.begin() + T);
  for (int page : {16, 64, 256}) {
    CacheConfig cc = cache_capacity(c, 1, T, page);
    BlockManager bm(cache_spec(c), cc);
    HostCache cache(c, cc);
    SequenceCache seq = bm.begin_sequence();
    bm.reserve(seq, T);
    for (int k = 0; k < c.n_layers; ++k) {
      const int ratio = c.ratio(k);
      if (ratio == 0) continue;
      SCOPED_TRACE(g.name + " L" + std::to_string(k) + " page " + std::to_string(page));
      std::vector<float> x = to_floats(g.get("prefill0129.attn_in.L" + std::to_string(k)));
      std::vector<float> out(size_t(T) * dim);
      std::vector<ChunkRef> chunks{{&seq, 0, tokens.data(), T}};
      lm.model->run_attention(k, chunks, x.data(), out.data(), cache);
      const int n = T / ratio;
      std::vector<float> ref = to_floats(g.get(key(k, "compressed")));
      ref.resize(size_t(n) * D);
      const std::vector<float> ours = read_compressed(cache, k, seq, n);
      const StepCheck st = kv_steps(cache, k, seq, n, false, ref);
      if (page == 64)
        std::printf("[%s] L%d compressed 0..%d from stored inputs: %s\n", g.name.c_str(), k, n - 1,
                    to_string(compare(ours, ref)).c_str());
      EXPECT_GE(st.frac_equal, 0.999);
      EXPECT_EQ(st.beyond_one_step, 0u);
      if (ratio != 4) continue;
      std::vector<float> kref = to_floats(g.get(key(k, "indexer.keys")));
      kref.resize(size_t(n) * c.index_head_dim);
      const std::vector<float> keys = read_index_keys(cache, k, seq, n);
      const StepCheck sk = key_steps(cache, k, seq, n, kref);
      if (page == 64)
        std::printf("[%s] L%d indexer keys 0..%d from stored inputs: %s\n", g.name.c_str(), k,
                    n - 1, to_string(compare(keys, kref)).c_str());
      EXPECT_GE(sk.frac_equal, 0.999);
      EXPECT_EQ(sk.beyond_one_step, 0u);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sets, GoldenCache,
                         ::testing::ValuesIn(golden_sets().empty()
                                                 ? std::vector<std::string>{"none"}
                                                 : golden_sets()));

}  // namespace
}  // namespace dsv4::test
