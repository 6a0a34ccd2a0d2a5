// The CUDA backend against the official reference's golden sets ($DSV4_GOLDEN_DIR or
// ../shared/golden; every set and every checkpoint format present; skipped, saying so,
// without them), with the checks and thresholds of the CPU golden tests on the GPU path:
//  - end to end per case (golden_e2e_test): min cosine >= 0.999, mean >= 0.9999, max |d logit|
//    <= 0.7, argmax agreement >= 97 % (rows whose reference top-2 gap is a near tie excused,
//    the raw figure over a set also >= 97 %), greedy continuations; on both linear paths
//    (FP8 tensor cores, the default, and --exact-linears);
//  - layer-local (golden_layers_test): each block's attention, MoE and whole block from the
//    reference's stored inputs (prefill of 129 tokens), and the decode steps 297..299 replayed
//    from the reference's stored caches;
//    (these and the cache contents on the exact-linears path: see golden_options);
//  - cache contents (golden_cache_test): every store after our own 300-token prefill, and the
//    compressed entries / indexer keys computed from the stored attention inputs at page sizes
//    16, 64 and 256;
//  - the MTP block's logits, and the NVFP4 and MXFP4 checkpoints of a set against each other.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "backends/cpu/cache_io.h"
#include "core/error.h"
#include "cuda/engine_test_support.h"
#include "model/cache_spec.h"
#include "support/golden.h"
#include "support/golden_cache.h"

namespace dsv4::test {
namespace {

struct SetFormat {
  std::string set, fmt;
};

std::vector<SetFormat> cases() {
  std::vector<SetFormat> v;
  for (const std::string& s : golden_sets())
    for (const char* f : {"mxfp4", "nvfp4"})
      if (std::filesystem::exists(golden_root() + "/" + s + "/hf-" + f + "/config.json"))
        v.push_back({s, f});
  if (v.empty()) v.push_back({"none", "none"});
  return v;
}

std::string case_name(const ::testing::TestParamInfo<SetFormat>& i) {
  std::string n = i.param.set + "_" + i.param.fmt;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

class EngineGolden : public ::testing::TestWithParam<SetFormat> {
 protected:
  void SetUp() override {
    DSV4_SKIP_WITHOUT_GPU();
    if (golden_root().empty() || GetParam().set == "none")
      GTEST_SKIP() << "golden data not found (set DSV4_GOLDEN_DIR; scripts/h200/pack.sh carries "
                      "one set)";
  }
  std::string checkpoint(const GoldenSet& g) const { return g.checkpoint(GetParam().fmt); }
  std::string tag(const GoldenSet& g) const { return g.name + "/" + GetParam().fmt; }
  void logits_and_greedy(bool exact);
};

// ---- helpers -------------------------------------------------------------------------------

// A fresh device cache of one sequence holding `tokens` tokens at `page` entries per page, and
// the step metadata buffers for it.
struct Fresh {
  CacheConfig cc;
  BlockManager bm;
  DeviceCache cache;
  SequenceCache seq;
  StepBuffers meta;
  Fresh(const CudaModel& m, int64_t tokens, int page)
      : cc(cache_capacity(m.config(), 1, tokens, page)),
        bm(cache_spec(m.config()), cc),
        cache(m.config(), cc),
        meta(limits(m, tokens, page), m.config().window_size) {
    seq = bm.begin_sequence();
    bm.reserve(seq, tokens);
  }
  static StepLimits limits(const CudaModel& m, int64_t tokens, int page) {
    StepLimits l;
    l.max_tokens = m.limits().max_tokens;
    l.max_seqs = 1;
    auto pages = [&](int64_t e) { return int(std::max<int64_t>(1, (e + page - 1) / page)); };
    l.stride[0] = pages(m.config().window_size);
    l.stride[1] = pages(tokens / 4);
    l.stride[2] = pages(tokens / 128);
    return l;
  }
  DeviceStep step(const CudaModel& m, int64_t start, const int32_t* tokens, int n) {
    return meta.build({{&seq, start, tokens, n}}, {}, -1, m.stream());
  }
};

// exact: FP8 linears on the exact W8A16 path (--exact-linears), which the layer-local and
// cache-content checks need: the reference's sums are exact, and the FP8 tensor cores' ~14-bit
// sums inside a K block move ~0.7 % of GEMM outputs more than an ulp, which the next FP8
// activation quantisation turns into e4m3 steps (attn_out 1.8e-2 - 3.2e-2 relative L2 from
// the stored inputs on the FP8 path, against the README's 1e-2). End to end both paths are held
// to the README's tolerance.
CudaStackOptions golden_options(bool exact = false) {
  CudaStackOptions o;
  o.exact_linears = exact;
  o.max_seqs = 2;
  o.max_context = 320;
  o.max_step_tokens = 320;
  return o;
}

// ---- end to end ----------------------------------------------------------------------------

void EngineGolden::logits_and_greedy(bool exact) {
  GoldenSet g(GetParam().set);
  std::printf("[%s] FP8 linears on the %s path\n", tag(g).c_str(),
              exact ? "exact W8A16" : "FP8 tensor-core");
  auto s = open_cuda_stack(checkpoint(g), golden_options(exact));
  CudaRunner& runner = *s->runner;
  const int V = s->V();
  nlohmann::json summary = nlohmann::json::parse(std::ifstream(g.dir + "/summary.json"));
  E2eChecker chk;
  chk.t.near_tie =
      std::max(0.1, summary["self_agreement_prefill_vs_tbt"]["ALL"]["max_abs_diff"].get<double>());
  std::printf("[%s] near-tie gap %.3f\n", tag(g).c_str(), chk.t.near_tie);
  for (int Lp : {1, 4, 5, 127, 129, 257, 300}) {
    char key[16];
    std::snprintf(key, sizeof key, "len%04d", Lp);
    const std::string k = key;
    std::vector<int32_t> toks = as_tokens(to_ints(g.get(k + ".prefill.tokens")));
    std::vector<float> ours = forced_logits(runner, toks, Lp);
    std::vector<int64_t> pos = to_ints(g.get(k + ".prefill.positions"));
    std::vector<float> gold = to_floats(g.get(k + ".prefill.logits"));
    std::vector<float> mine = pick(ours, pos, V);
    std::printf("[%s] %s\n", tag(g).c_str(), k.c_str());
    chk.check("prefill mode", mine.data(), gold.data(), pos.size(), V);
    EXPECT_EQ(check_greedy(ours, gold, pos, toks, Lp, V, chk.t.near_tie), "") << k << " prefill";
    if (Lp == 300) {
      std::vector<int32_t> tt = as_tokens(to_ints(g.get(k + ".tbt.tokens")));
      std::vector<float> ours_t = forced_logits(runner, tt, 1, 1);
      std::vector<float> gold_t = to_floats(g.get(k + ".tbt.logits"));
      const size_t rows = gold_t.size() / V;
      ours_t.resize(rows * V);
      chk.check("token-by-token mode", ours_t.data(), gold_t.data(), rows, V);
      std::vector<int64_t> all_pos(rows);
      for (size_t i = 0; i < rows; ++i) all_pos[i] = int64_t(i);
      EXPECT_EQ(check_greedy(ours_t, gold_t, all_pos, tt, Lp, V, chk.t.near_tie), "")
          << k << " tbt";
    }
  }
  // The batch: both rows in every step (one prefill of the common 61 tokens, then lockstep).
  const GoldenBatch batch = golden_batch(g);
  const std::vector<std::vector<float>> batch_rows = batch_logits(runner, batch, V);
  for (int b = 0; b < 2; ++b) {
    const std::string name = "batch.prefill.logits.row" + std::to_string(b);
    std::vector<float> gold = to_floats(g.get(name));
    const size_t rows = gold.size() / V;
    const std::vector<float>& ours = batch_rows[b];
    std::printf("[%s] batch row %d\n", tag(g).c_str(), b);
    chk.check("prefill mode", ours.data(), gold.data(), rows, V);
    std::vector<int64_t> pos(rows);
    for (size_t i = 0; i < rows; ++i) pos[i] = int64_t(i);
    EXPECT_EQ(check_greedy(ours, gold, pos, batch.rows[b], int(batch.lens[b]), V, chk.t.near_tie),
              "")
        << name;
    std::vector<float> gt = to_floats(g.get("batch.tbt.logits"));
    const size_t trows = gt.size() / V / 2;
    chk.check("token-by-token mode", ours.data(), gt.data() + b * trows * V, trows, V);
  }
  const double raw = double(chk.agree) / double(chk.rows);
  std::printf("[%s] raw argmax agreement over all %zu rows: %.2f%%\n", tag(g).c_str(), chk.rows,
              100 * raw);
  EXPECT_GE(raw, 0.97);
}

// ---- layer-local ---------------------------------------------------------------------------

TEST_P(EngineGolden, LogitsAndGreedyTokens) {
  logits_and_greedy(false);
}
TEST_P(EngineGolden, LogitsAndGreedyTokensExactLinears) {
  logits_and_greedy(true);
}

TEST_P(EngineGolden, LayersPrefill129) {
  GoldenSet g(GetParam().set);
  auto s = open_cuda_stack(checkpoint(g), golden_options(true));
  CudaModel& m = *s->model;
  const ModelConfig& c = s->config;
  const int T = 129, dim = c.dim, K = c.n_activated_experts;
  const std::string pre = "prefill0129";
  std::vector<int32_t> tokens(g.master_prompt.begin(), g.master_prompt.begin() + T);
  cuda::DeviceBuffer<uint16_t> out(size_t(T) * dim), streams(size_t(T) * c.hc_mult * dim);
  for (int k = 0; k < c.n_layers; ++k) {
    SCOPED_TRACE(tag(g) + " L" + std::to_string(k));
    const std::vector<float> g_attn_in = to_floats(g.get(layer_key(pre, "attn_in", k)));
    const std::vector<float> g_attn_out = to_floats(g.get(layer_key(pre, "attn_out", k)));
    const std::vector<float> g_ffn_in = to_floats(g.get(layer_key(pre, "ffn_in", k)));
    const std::vector<float> g_ffn_out = to_floats(g.get(layer_key(pre, "ffn_out", k)));
    const std::vector<float> g_out = to_floats(g.get(layer_key(pre, "hidden.out", k)));

    // Attention from the stored attention input (fresh caches).
    RecordingTrace tr;
    m.set_trace(&tr);
    Fresh a(m, T, 64);
    cuda::DeviceBuffer<uint16_t> x = to_device_bf16(g_attn_in);
    m.run_attention(k, a.step(m, 0, tokens.data(), T), a.cache, bf16_ptr(x), bf16_ptr(out));
    const Diff da = compare(from_device_bf16(out.data(), out.size()), g_attn_out);
    EXPECT_LE(da.rel_l2, 1e-2);

    // MoE from the stored MoE input: routing and output.
    cuda::DeviceBuffer<uint16_t> xf = to_device_bf16(g_ffn_in);
    m.run_moe(k, a.step(m, 0, tokens.data(), T), bf16_ptr(xf), bf16_ptr(out));
    const Diff df = compare(from_device_bf16(out.data(), out.size()), g_ffn_out);
    EXPECT_LE(df.rel_l2, 2e-3);
    EXPECT_GE(df.frac_1ulp, 0.99);
    const std::vector<int64_t> gexp =
        to_ints(g.get(pre + ".route.L" + std::to_string(k) + ".experts"));
    const std::vector<float> gw =
        to_floats(g.get(pre + ".route.L" + std::to_string(k) + ".weights"));
    const std::vector<int32_t>& rexp = tr.i(k, 0, "route.experts");
    for (size_t i = 0; i < gexp.size(); ++i) ASSERT_EQ(rexp[i], gexp[i]) << "routing row " << i / K;
    // fp32 router logits summed in another order than the reference's: ~1e-7 relative.
    EXPECT_LE(compare(tr.f(k, 0, "route.weights"), gw).rel_l2, 1e-5);

    // The whole block from the stored block input.
    Fresh b(m, T, 64);
    upload_bf16(streams, block_input(g, pre, k));
    RecordingTrace trb;
    m.set_trace(&trb);
    m.run_block(k, b.step(m, 0, tokens.data(), T), b.cache, bf16_ptr(streams));
    m.set_trace(nullptr);
    const Diff din = compare(trb.f(k, 0, "attn_in"), g_attn_in);
    const Diff dout = compare(from_device_bf16(streams.data(), streams.size()), g_out);
    EXPECT_GE(din.frac_equal, 0.999);
    EXPECT_GE(din.frac_1ulp, 0.9999);
    const bool exact_input = din.frac_equal == 1.0;
    if (c.ratio(k) != 4 || exact_input) {
      EXPECT_GE(dout.frac_1ulp, 0.97);
    }
    EXPECT_LE(dout.rel_l2, 1e-2);
    std::printf("[%s] L%d (ratio %d) attn_out %s\n    ffn_out %s\n    block %s%s\n", tag(g).c_str(),
                k, c.ratio(k), to_string(da).c_str(), to_string(df).c_str(),
                to_string(dout).c_str(),
                exact_input ? "" : " (attention input differs: CSA selection may differ)");
    if (c.ratio(k) == 4) {
      const std::vector<int64_t> gsel =
          to_ints(g.get(pre + ".indexer.L" + std::to_string(k) + ".selected"));
      const auto& sel = tr.i(k, 0, "indexer.selected");
      const int same_rows = identical_selection_rows(sel, gsel, T, c.index_topk);
      std::printf("    indexer selections identical at %d/%d positions\n", same_rows, T);
      EXPECT_GE(same_rows, T * 99 / 100);
    }
  }
}

TEST_P(EngineGolden, DecodeStepsFromStoredCaches) {
  GoldenSet g(GetParam().set);
  auto s = open_cuda_stack(checkpoint(g), golden_options(true));
  CudaModel& m = *s->model;
  const ModelConfig& c = s->config;
  const int dim = c.dim, V = c.vocab_size;
  Fresh attn(m, 300, 64), chain(m, 300, 64);
  for (Fresh* f : {&attn, &chain}) {
    HostCache host(c, f->cc);
    load_golden_caches(g, "tbt0300.cache_before0297", c, host, f->seq, 297);
    f->cache.upload(host);
  }
  const std::vector<float> g_logits = to_floats(g.get("len0300.tbt.logits"));
  cuda::DeviceBuffer<uint16_t> out(dim), streams(size_t(c.hc_mult) * dim);
  double sum = 0, worst = 0;
  int n = 0;
  for (int step = 297; step < 300; ++step) {
    const std::string pre = "tbt0300.step0" + std::to_string(step);
    const int32_t token = g.master_prompt[step];
    upload_bf16(streams, block_input(g, pre, 0));
    for (int k = 0; k < c.n_layers; ++k) {
      SCOPED_TRACE(tag(g) + " step " + std::to_string(step) + " L" + std::to_string(k));
      cuda::DeviceBuffer<uint16_t> x =
          to_device_bf16(to_floats(g.get(layer_key(pre, "attn_in", k))));
      m.run_attention(k, attn.step(m, step, &token, 1), attn.cache, bf16_ptr(x), bf16_ptr(out));
      const Diff da = compare(from_device_bf16(out.data(), dim),
                              to_floats(g.get(layer_key(pre, "attn_out", k))));
      EXPECT_LE(da.rel_l2, 3e-2);
      sum += da.rel_l2, worst = std::max(worst, da.rel_l2), ++n;
      cuda::DeviceBuffer<uint16_t> xf =
          to_device_bf16(to_floats(g.get(layer_key(pre, "ffn_in", k))));
      m.run_moe(k, attn.step(m, step, &token, 1), bf16_ptr(xf), bf16_ptr(out));
      const Diff df = compare(from_device_bf16(out.data(), dim),
                              to_floats(g.get(layer_key(pre, "ffn_out", k))));
      EXPECT_LE(df.rel_l2, 2e-3);
      EXPECT_GE(df.frac_1ulp, 0.99);
      m.run_block(k, chain.step(m, step, &token, 1), chain.cache, bf16_ptr(streams));
      std::printf("[%s] step %d L%d attn_out %s\n", tag(g).c_str(), step, k, to_string(da).c_str());
    }
    m.logits_of(bf16_ptr(streams), 1);
    std::vector<float> logits(V);
    DSV4_CUDA_CHECK(cudaStreamSynchronize(m.stream()));
    DSV4_CUDA_CHECK(cudaMemcpy(logits.data(), m.logits(), V * 4, cudaMemcpyDeviceToHost));
    const LogitStats st = logit_stats(logits.data(), g_logits.data() + size_t(step) * V, 1, V);
    std::printf("[%s] step %d chained logits vs reference: %s\n", tag(g).c_str(), step,
                to_string(st).c_str());
    EXPECT_GE(st.min_cos, 0.999);
    EXPECT_LE(st.max_abs, 0.7);
    attn.seq.tokens = chain.seq.tokens = step + 1;
  }
  std::printf("[%s] decode attn_out relL2: mean %.3g, worst %.3g\n", tag(g).c_str(), sum / n,
              worst);
  EXPECT_LE(sum / n, 2e-2);
}

// ---- cache contents ------------------------------------------------------------------------

// Identical fractions are judged from this many elements, as the verifier judges a store only
// once it holds >= 10000 bytes (cuda_verify.h): on a 2-entry store (1024 elements) 99.9 % would
// mean "at most one element differs", a coin toss rather than a measurement.
constexpr size_t kMinCacheSample = 10000;

std::string ckey(int k, const std::string& what) {
  return "prefill0300.cache.L" + std::to_string(k) + "." + what;
}

TEST_P(EngineGolden, CacheAfterOwnPrefill300) {
  GoldenSet g(GetParam().set);
  CudaStackOptions o = golden_options(true);
  o.max_seqs = 1;
  auto s = open_cuda_stack(checkpoint(g), o);
  const ModelConfig& c = s->config;
  const int T = 300;
  CudaRunner& r = *s->runner;
  const int id = r.open_sequence();
  r.step_logits(
      {{id, std::vector<int32_t>(g.master_prompt.begin(), g.master_prompt.begin() + T), false}});
  SequenceCache& seq = r.sequence(id);
  HostCache host(c, r.blocks().config());
  r.cache().download(host);
  for (int k = 0; k < c.n_layers; ++k) {
    SCOPED_TRACE(tag(g) + " L" + std::to_string(k));
    const bool exact_inputs = k == 0;
    auto check_kv = [&](const char* what, const std::vector<float>& ours, bool window, int n) {
      const std::vector<float> ref = to_floats(g.get(ckey(k, what)));
      const Diff d = compare(ours, ref);
      const StepCheck st = kv_steps(host, k, seq, n, window, ref);
      std::printf("[%s] L%d %-22s %s, beyond one step %zu (%zu beyond float rounding)%s%s\n",
                  tag(g).c_str(), k, what, to_string(d).c_str(), st.beyond_one_step,
                  st.beyond_rounding,
                  st.first_beyond.empty() ? "" : ", first: ", st.first_beyond.c_str());
      if (exact_inputs) {
        // Our compressor projections are summed by cuBLAS in another order than the
        // reference's (equal up to float rounding, which issue 3 allows): see StepCheck.
        if (st.elements >= kMinCacheSample) {
          EXPECT_GE(st.frac_equal, 0.999) << what;
        }
        EXPECT_EQ(st.beyond_rounding, 0u) << what;
      } else {
        EXPECT_LE(d.rel_l2, 5e-2) << what;
      }
    };
    check_kv("window", read_window(host, k, seq), true, c.window_size);
    const int ratio = c.ratio(k);
    if (ratio == 0) continue;
    check_kv("compressed", read_compressed(host, k, seq, T / ratio), false, T / ratio);
    for (bool indexer : {false, true}) {
      if (indexer && ratio != 4) continue;
      const std::string base = indexer ? "indexer.compressor." : "compressor.";
      std::vector<float> kv = state_kv(host, k, indexer, seq.state_slot, T);
      std::vector<float> sc = state_score(host, k, indexer, seq.state_slot, T);
      std::vector<float> gkv = to_floats(g.get(ckey(k, base + "kv_state")));
      std::vector<float> gsc = to_floats(g.get(ckey(k, base + "score_state")));
      if (ratio == 4) {
        const size_t valid = size_t(4 + T % 4) * (kv.size() / 8);
        kv.resize(valid), sc.resize(valid), gkv.resize(valid), gsc.resize(valid);
      }
      const Diff dk = compare(kv, gkv), ds = compare(sc, gsc);
      std::printf("[%s] L%d %-22s kv %s, score relL2 %.3g\n", tag(g).c_str(), k,
                  (base + "state").c_str(), to_string(dk).c_str(), ds.rel_l2);
      EXPECT_LE(dk.rel_l2, exact_inputs ? 1e-5 : 1e-2);
      EXPECT_LE(ds.rel_l2, exact_inputs ? 1e-5 : 1e-2);
    }
    if (ratio == 4) {
      const std::vector<float> ours = read_index_keys(host, k, seq, T / 4);
      const std::vector<float> ref = to_floats(g.get(ckey(k, "indexer.keys")));
      const StepCheck st = key_steps(host, k, seq, T / 4, ref);
      std::printf("[%s] L%d %-22s %s\n", tag(g).c_str(), k, "indexer.keys",
                  to_string(compare(ours, ref)).c_str());
      if (exact_inputs)
        EXPECT_GE(st.frac_equal, 0.999);
      else
        EXPECT_LE(compare(ours, ref).rel_l2, 1e-1);
    }
  }
  r.close_sequence(id);
}

TEST_P(EngineGolden, CompressedEntriesFromStoredInputs) {
  GoldenSet g(GetParam().set);
  auto s = open_cuda_stack(checkpoint(g), golden_options());
  CudaModel& m = *s->model;
  const ModelConfig& c = s->config;
  const int T = 129, D = c.head_dim, dim = c.dim;
  std::vector<int32_t> tokens(g.master_prompt.begin(), g.master_prompt.begin() + T);
  cuda::DeviceBuffer<uint16_t> out(size_t(T) * dim);
  for (int page : {16, 64, 256}) {
    for (int k = 0; k < c.n_layers; ++k) {
      const int ratio = c.ratio(k);
      if (ratio == 0) continue;
      SCOPED_TRACE(tag(g) + " L" + std::to_string(k) + " page " + std::to_string(page));
      Fresh f(m, T, page);
      cuda::DeviceBuffer<uint16_t> x =
          to_device_bf16(to_floats(g.get("prefill0129.attn_in.L" + std::to_string(k))));
      m.run_attention(k, f.step(m, 0, tokens.data(), T), f.cache, bf16_ptr(x), bf16_ptr(out));
      HostCache host(c, f.cc);
      f.cache.download(host);
      const int n = T / ratio;
      std::vector<float> ref = to_floats(g.get(ckey(k, "compressed")));
      ref.resize(size_t(n) * D);
      const StepCheck st = kv_steps(host, k, f.seq, n, false, ref);
      if (page == 64)
        std::printf("[%s] L%d compressed 0..%d from stored inputs: %s\n", tag(g).c_str(), k, n - 1,
                    to_string(compare(read_compressed(host, k, f.seq, n), ref)).c_str());
      EXPECT_GE(st.frac_equal, 0.999);
      EXPECT_EQ(st.beyond_one_step, 0u);
      if (ratio != 4) continue;
      std::vector<float> kref = to_floats(g.get(ckey(k, "indexer.keys")));
      kref.resize(size_t(n) * c.index_head_dim);
      const StepCheck sk = key_steps(host, k, f.seq, n, kref);
      EXPECT_GE(sk.frac_equal, 0.999);
      EXPECT_EQ(sk.beyond_one_step, 0u);
    }
  }
}

// ---- MTP and formats -----------------------------------------------------------------------

TEST_P(EngineGolden, MtpLogits) {
  GoldenSet g(GetParam().set);
  auto s = open_cuda_stack(checkpoint(g), golden_options());
  CudaModel& m = *s->model;
  CudaRunner& r = *s->runner;
  const ModelConfig& c = s->config;
  const int V = c.vocab_size, hc = c.hc_mult, dim = c.dim;
  ASSERT_GE(c.n_mtp_layers, 1);
  StepBuffers meta(Fresh::limits(m, 320, 64), c.window_size);
  for (int Lp : {5, 129}) {
    char key[16];
    std::snprintf(key, sizeof key, "len%04d", Lp);
    const std::string k = key;
    std::vector<int64_t> ids64 = to_ints(g.get(k + ".mtp.input_ids"));
    std::vector<int32_t> ids(ids64.begin(), ids64.end());
    std::vector<int64_t> pos = to_ints(g.get(k + ".mtp.positions"));
    std::vector<float> gold = to_floats(g.get(k + ".mtp.logits"));
    const int id = r.open_sequence();
    r.step(
        {{id, std::vector<int32_t>(g.master_prompt.begin(), g.master_prompt.begin() + Lp), false}});
    cuda::DeviceBuffer<uint16_t> own(size_t(Lp) * hc * dim);
    DSV4_CUDA_CHECK(cudaMemcpy(own.data(), m.hidden(), own.bytes(), cudaMemcpyDeviceToDevice));
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    auto run_mtp = [&](const __nv_bfloat16* h) {
      SequenceCache& seq = r.sequence(id);
      seq.mtp_tokens = 0;
      const DeviceStep st = meta.build({{&seq, 0, ids.data(), Lp}}, {}, -1, m.stream());
      m.mtp_forward(0, st, h, r.cache());
      std::vector<float> all(size_t(Lp) * V);
      DSV4_CUDA_CHECK(cudaStreamSynchronize(m.stream()));
      DSV4_CUDA_CHECK(cudaMemcpy(all.data(), m.logits(), all.size() * 4, cudaMemcpyDeviceToHost));
      return pick(all, pos, V);
    };
    auto expect_e2e = [&](const std::string& what, const LogitStats& st, bool check_mean) {
      std::printf("    [%s] %-44s %s\n", tag(g).c_str(), what.c_str(), to_string(st).c_str());
      EXPECT_GE(st.min_cos, 0.999) << what;
      if (check_mean) {
        EXPECT_GE(st.mean_cos, 0.9999) << what;
      }
      EXPECT_LE(st.max_abs, 0.7) << what;
    };
    expect_e2e(k + " MTP on our own prefill streams",
               logit_stats(run_mtp(bf16_ptr(own)).data(), gold.data(), pos.size(), V), false);
    std::vector<float> h =
        to_floats(g.get("prefill0129.hidden.out.L" + std::to_string(c.n_layers - 1)));
    h.resize(size_t(Lp) * hc * dim);
    cuda::DeviceBuffer<uint16_t> ref = to_device_bf16(h);
    expect_e2e(k + " MTP on the reference's streams",
               logit_stats(run_mtp(bf16_ptr(ref)).data(), gold.data(), pos.size(), V), Lp == 129);
    r.close_sequence(id);
  }
}

// The NVFP4 and MXFP4 checkpoints of a set hold the same expert values (a lossless cast): on
// the GPU their logits must agree end to end; printed: whether bit for bit.
TEST_P(EngineGolden, Nvfp4AgreesWithMxfp4) {
  GoldenSet g(GetParam().set);
  if (GetParam().fmt != "nvfp4") GTEST_SKIP() << "run once per set, from its nvfp4 case";
  if (!std::filesystem::exists(g.checkpoint("mxfp4") + "/config.json"))
    GTEST_SKIP() << "the set has no MXFP4 checkpoint here (scripts/h200/pack.sh carries one "
                    "format)";
  const int T = 300;
  std::vector<int32_t> prompt(g.master_prompt.begin(), g.master_prompt.begin() + T);
  auto run = [&](const std::string& fmt) {
    auto s = open_cuda_stack(g.checkpoint(fmt), golden_options());
    const int id = s->runner->open_sequence();
    return s->runner->step_logits({{id, prompt, true}});
  };
  const std::vector<float> mx = run("mxfp4"), nv = run("nvfp4");
  std::printf("[%s] NVFP4 vs MXFP4 over %d positions\n", g.name.c_str(), T);
  expect_logits_close("prefill 300", nv, mx, int(mx.size() / T));
}

INSTANTIATE_TEST_SUITE_P(Sets, EngineGolden, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace dsv4::test
