// Layer-local checks against the official reference: each block, and each sub-layer of it,
// fed the reference's own stored inputs must reproduce its stored outputs (golden README,
// "Tolerance guidance"). Prefill of the 129-token prompt, and the decode steps 297..299
// replayed from the reference's stored caches.
//
// Two effects shape the tolerances, both measured on these sets (see the issue notes):
// * CSA layers select compressed blocks by BF16 top-k over FP4 keys; a one-ulp difference in
//   the attention input can change a selection (README quirk 2), so a whole-block check of a
//   CSA block is exact only when its attention input is.
// * At positions whose 128-key window is full (every decode step here), the attention
//   output is ill-conditioned: two legitimate roundings of the softmax probabilities (BF16
//   against the running max, or none) differ by 1e-2..2e-2 in relative L2 (the
//   DecodeAttentionConditioning test measures it), so decode attention is held to 3e-2.
#include <gtest/gtest.h>

#include <cstdio>

#include <cmath>

#include "backends/cpu/cache_io.h"
#include "backends/cpu/runner.h"
#include "model/cache_spec.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/mhc.h"
#include "ops/cpu/norm.h"
#include "ops/cpu/quant.h"
#include "ops/cpu/rope.h"
#include "support/golden.h"
#include "support/golden_cache.h"

namespace dsv4::test {
namespace {

constexpr double kAttnRelL2 = 1e-2;        // README: attn_out from attn_in
constexpr double kDecodeAttnRelL2 = 3e-2;  // full-window positions (see above)
constexpr double kFfnRelL2 = 2e-3;         // README: ffn_out from ffn_in
constexpr double kFfnWithin1Ulp = 0.99;
constexpr double kBlockWithin1Ulp = 0.97;  // README: block outputs

// The block's residual algebra alone: its output from the stored block input and the stored
// sub-layer outputs (hc_pre and hc_post of both sub-layers).
std::vector<float> mhc_only(const LoadedModel& lm, int k, const std::vector<float>& in,
                            const std::vector<float>& attn_out, const std::vector<float>& ffn_out) {
  const ModelConfig& c = lm.config;
  const auto& bw = lm.model->weights().blocks[k];
  const int hc = c.hc_mult, dim = c.dim;
  const int rows = static_cast<int>(in.size() / (size_t(hc) * dim));
  std::vector<float> out(in.size()), mid(size_t(hc) * dim), y(dim), post(hc), comb(hc * hc);
  for (int t = 0; t < rows; ++t) {
    const float* h = in.data() + size_t(t) * hc * dim;
    cpu::hc_pre(hc_params(c, bw.hc_attn), h, y.data(), post.data(), comb.data());
    cpu::hc_post(hc, dim, attn_out.data() + size_t(t) * dim, h, post.data(), comb.data(),
                 mid.data());
    cpu::hc_pre(hc_params(c, bw.hc_ffn), mid.data(), y.data(), post.data(), comb.data());
    cpu::hc_post(hc, dim, ffn_out.data() + size_t(t) * dim, mid.data(), post.data(), comb.data(),
                 out.data() + size_t(t) * hc * dim);
  }
  return out;
}

struct Fresh {
  CacheConfig cc;
  BlockManager bm;
  HostCache cache;
  SequenceCache seq;
  Fresh(const ModelConfig& c, int64_t tokens, int page)
      : cc(cache_capacity(c, 1, tokens, page)), bm(cache_spec(c), cc), cache(c, cc) {
    seq = bm.begin_sequence();
    bm.reserve(seq, tokens);
  }
};

class GoldenLayers : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (golden_root().empty()) GTEST_SKIP() << "golden data not found (set DSV4_GOLDEN_DIR)";
  }
};

TEST_P(GoldenLayers, Prefill129) {
  GoldenSet g(GetParam());
  LoadedModel lm = load_cpu_model(g.checkpoint("mxfp4"));
  const ModelConfig& c = lm.config;
  const int T = 129, dim = c.dim, K = c.n_activated_experts;
  const std::string pre = "prefill0129";
  std::vector<int32_t> tokens(g.master_prompt.begin(), g.master_prompt.begin() + T);
  double worst_attn = 0, worst_block = 1;
  for (int k = 0; k < c.n_layers; ++k) {
    SCOPED_TRACE(g.name + " L" + std::to_string(k));
    const std::vector<float> in = block_input(g, pre, k);
    const std::vector<float> g_attn_in = to_floats(g.get(layer_key(pre, "attn_in", k)));
    const std::vector<float> g_attn_out = to_floats(g.get(layer_key(pre, "attn_out", k)));
    const std::vector<float> g_ffn_in = to_floats(g.get(layer_key(pre, "ffn_in", k)));
    const std::vector<float> g_ffn_out = to_floats(g.get(layer_key(pre, "ffn_out", k)));
    const std::vector<float> g_out = to_floats(g.get(layer_key(pre, "hidden.out", k)));

    // Attention from the stored attention input (fresh caches).
    Fresh a(c, T, 64);
    std::vector<ChunkRef> chunks{{&a.seq, 0, tokens.data(), T}};
    std::vector<float> attn_out(size_t(T) * dim);
    RecordingTrace tr;
    lm.model->run_attention(k, chunks, g_attn_in.data(), attn_out.data(), a.cache, &tr);
    const Diff da = compare(attn_out, g_attn_out);
    EXPECT_LE(da.rel_l2, kAttnRelL2);
    worst_attn = std::max(worst_attn, da.rel_l2);

    // MoE from the stored MoE input: routing and output.
    std::vector<float> ffn_out(size_t(T) * dim), rw(size_t(T) * K);
    std::vector<int32_t> rexp(size_t(T) * K);
    lm.model->run_moe(k, tokens.data(), T, g_ffn_in.data(), ffn_out.data(), rexp.data(), rw.data());
    const Diff df = compare(ffn_out, g_ffn_out);
    EXPECT_LE(df.rel_l2, kFfnRelL2);
    EXPECT_GE(df.frac_1ulp, kFfnWithin1Ulp);
    const std::vector<int64_t> gexp =
        to_ints(g.get(pre + ".route.L" + std::to_string(k) + ".experts"));
    const std::vector<float> gw =
        to_floats(g.get(pre + ".route.L" + std::to_string(k) + ".weights"));
    for (size_t i = 0; i < gexp.size(); ++i) ASSERT_EQ(rexp[i], gexp[i]) << "routing row " << i / K;
    EXPECT_LE(compare(rw, gw).rel_l2, 1e-6);

    // The residual algebra (hc_pre / hc_post) from stored sub-layer outputs.
    const Diff dm = compare(mhc_only(lm, k, in, g_attn_out, g_ffn_out), g_out);
    EXPECT_GE(dm.frac_equal, 0.9999);

    // The whole block from the stored block input.
    Fresh b(c, T, 64);
    std::vector<float> x = in;
    RecordingTrace trb;
    std::vector<ChunkRef> chunks_b{{&b.seq, 0, tokens.data(), T}};
    lm.model->run_block(k, chunks_b, x.data(), b.cache, &trb);
    const Diff din = compare(trb.f(k, 0, "attn_in"), g_attn_in);
    const Diff dout = compare(x, g_out);
    EXPECT_GE(din.frac_equal, 0.999);
    EXPECT_GE(din.frac_1ulp, 0.9999);
    const bool exact_input = din.frac_equal == 1.0;
    if (c.ratio(k) != 4 || exact_input) {
      EXPECT_GE(dout.frac_1ulp, kBlockWithin1Ulp);
    }
    EXPECT_LE(dout.rel_l2, kAttnRelL2);
    worst_block = std::min(worst_block, dout.frac_1ulp);

    std::printf(
        "[%s] L%d (ratio %d) attn_out %s\n    ffn_out %s\n    mHC-only block %s\n    "
        "block %s%s\n",
        g.name.c_str(), k, c.ratio(k), to_string(da).c_str(), to_string(df).c_str(),
        to_string(dm).c_str(), to_string(dout).c_str(),
        exact_input ? "" : " (attention input differs: CSA selection may differ)");
    if (c.ratio(k) == 4) {
      // Selections from identical inputs match except where an FP4 key rounds on a tie.
      const std::vector<int64_t> gsel =
          to_ints(g.get(pre + ".indexer.L" + std::to_string(k) + ".selected"));
      const auto& sel = tr.i(k, 0, "indexer.selected");
      const int same_rows = identical_selection_rows(sel, gsel, T, c.index_topk);
      std::printf("    indexer selections identical at %d/%d positions\n", same_rows, T);
      EXPECT_GE(same_rows, T * 99 / 100);
    }
  }
  std::printf("[%s] prefill worst attn_out relL2 %.3g, worst block within-1ulp %.4f\n",
              g.name.c_str(), worst_attn, worst_block);
}

// Cache replay: the reference's caches before the decode step of position 297 loaded into
// our stores, then its steps 297..299 block by block from its stored inputs.
TEST_P(GoldenLayers, DecodeStepsFromStoredCaches) {
  GoldenSet g(GetParam());
  LoadedModel lm = load_cpu_model(g.checkpoint("mxfp4"));
  const ModelConfig& c = lm.config;
  const int dim = c.dim, V = c.vocab_size;
  Fresh attn(c, 300, 64), chain(c, 300, 64);
  load_golden_caches(g, "tbt0300.cache_before0297", c, attn.cache, attn.seq, 297);
  load_golden_caches(g, "tbt0300.cache_before0297", c, chain.cache, chain.seq, 297);
  const std::vector<float> g_logits = to_floats(g.get("len0300.tbt.logits"));
  double sum = 0, worst = 0;
  int n = 0;
  for (int step = 297; step < 300; ++step) {
    const std::string pre = "tbt0300.step0" + std::to_string(step);
    int32_t token = g.master_prompt[step];
    std::vector<float> streams = block_input(g, pre, 0);
    for (int k = 0; k < c.n_layers; ++k) {
      SCOPED_TRACE(g.name + " step " + std::to_string(step) + " L" + std::to_string(k));
      std::vector<ChunkRef> ca{{&attn.seq, step, &token, 1}};
      const std::vector<float> g_attn_in = to_floats(g.get(layer_key(pre, "attn_in", k)));
      std::vector<float> attn_out(dim), ffn_out(dim);
      lm.model->run_attention(k, ca, g_attn_in.data(), attn_out.data(), attn.cache);
      const Diff da = compare(attn_out, to_floats(g.get(layer_key(pre, "attn_out", k))));
      EXPECT_LE(da.rel_l2, kDecodeAttnRelL2);
      sum += da.rel_l2, worst = std::max(worst, da.rel_l2), ++n;
      lm.model->run_moe(k, &token, 1, to_floats(g.get(layer_key(pre, "ffn_in", k))).data(),
                        ffn_out.data());
      const Diff df = compare(ffn_out, to_floats(g.get(layer_key(pre, "ffn_out", k))));
      EXPECT_LE(df.rel_l2, kFfnRelL2);
      EXPECT_GE(df.frac_1ulp, kFfnWithin1Ulp);
      const Diff dm = compare(
          mhc_only(lm, k, block_input(g, pre, k), to_floats(g.get(layer_key(pre, "attn_out", k))),
                   to_floats(g.get(layer_key(pre, "ffn_out", k)))),
          to_floats(g.get(layer_key(pre, "hidden.out", k))));
      EXPECT_GE(dm.frac_equal, 0.999);
      // The chained run: our own streams through every block, on our own caches.
      std::vector<ChunkRef> cc{{&chain.seq, step, &token, 1}};
      lm.model->run_block(k, cc, streams.data(), chain.cache);
      std::printf("[%s] step %d L%d attn_out %s\n", g.name.c_str(), step, k, to_string(da).c_str());
    }
    std::vector<float> logits(V);
    lm.model->logits(streams.data(), 1, logits.data());
    const LogitStats s = logit_stats(logits.data(), g_logits.data() + size_t(step) * V, 1, V);
    std::printf("[%s] step %d chained logits vs reference: %s\n", g.name.c_str(), step,
                to_string(s).c_str());
    EXPECT_GE(s.min_cos, 0.999);
    EXPECT_LE(s.max_abs, 0.7);
    attn.seq.tokens = chain.seq.tokens = step + 1;
  }
  std::printf("[%s] decode attn_out relL2: mean %.3g, worst %.3g\n", g.name.c_str(), sum / n,
              worst);
  EXPECT_LE(sum / n, 2e-2);
}

// The conditioning of attention at full-window positions, which sets kDecodeAttnRelL2: the
// same attention with and without BF16 rounding of its probabilities, from the stored
// input and caches, differs by about 1e-2 at these positions (were it far smaller, the
// decode tolerance would be loose).
TEST_P(GoldenLayers, DecodeAttentionConditioning) {
  GoldenSet g(GetParam());
  LoadedModel lm = load_cpu_model(g.checkpoint("mxfp4"));
  const ModelConfig& c = lm.config;
  Fresh f(c, 300, 64);
  load_golden_caches(g, "tbt0300.cache_before0297", c, f.cache, f.seq, 297);
  // The first layer without an indexer (its keys are fixed by position).
  int k = 0;
  while (c.ratio(k) == 4) ++k;
  const int p = 297, H = c.n_heads, D = c.head_dim, R = c.rope_head_dim;
  const auto& a = lm.model->weights().blocks[k].attn;
  const std::vector<float> x = to_floats(g.get(layer_key("tbt0300.step0297", "attn_in", k)));
  std::vector<float> cs(R / 2), sn(R / 2), qr(c.q_lora_rank), q(size_t(H) * D), kv(D);
  a.rope.cos_sin(p, cs.data(), sn.data());
  cpu::linear(a.wq_a, x.data(), 1, qr.data());
  cpu::rms_norm(qr.data(), 1, c.q_lora_rank, a.q_norm.data(), c.norm_eps, qr.data());
  cpu::linear(a.wq_b, qr.data(), 1, q.data());
  cpu::rms_norm_bf16_weightless(q.data(), H, D, c.norm_eps);
  for (int h = 0; h < H; ++h)
    cpu::rope_apply(q.data() + h * D + D - R, R, cs.data(), sn.data(), false);
  cpu::linear(a.wkv, x.data(), 1, kv.data());
  cpu::rms_norm(kv.data(), 1, D, a.kv_norm.data(), c.norm_eps, kv.data());
  cpu::rope_apply(kv.data() + D - R, R, cs.data(), sn.data(), false);
  cpu::fake_quant_fp8(kv.data(), D - R, 64, kv.data());
  const std::vector<float> ring = read_window(f.cache, k, f.seq);
  std::vector<const float*> keys;
  for (int j = p - c.window_size + 1; j < p; ++j)
    keys.push_back(ring.data() + size_t(j % c.window_size) * D);
  keys.push_back(kv.data());
  const int64_t ncomp = c.ratio(k) ? (p + 1) / c.ratio(k) : 0;
  const std::vector<float> comp = read_compressed(f.cache, k, f.seq, ncomp);
  for (int64_t i = 0; i < ncomp; ++i) keys.push_back(comp.data() + size_t(i) * D);
  auto output = [&](bool bf16_probs) {
    cpu::SparseAttnParams sp{H, D, static_cast<float>(1.0 / std::sqrt(double(D))), a.sink.data(),
                             bf16_probs};
    std::vector<float> o(size_t(H) * D), z(size_t(c.o_groups) * c.o_lora_rank), out(c.dim);
    cpu::sparse_attention(sp, q.data(), keys.data(), int(keys.size()), o.data());
    for (int h = 0; h < H; ++h)
      cpu::rope_apply(o.data() + h * D + D - R, R, cs.data(), sn.data(), true);
    const int in_g = c.heads_per_group() * D;
    for (int gi = 0; gi < c.o_groups; ++gi)
      cpu::linear(a.wo_a[gi], o.data() + size_t(gi) * in_g, 1,
                  z.data() + size_t(gi) * c.o_lora_rank);
    cpu::linear(a.wo_b, z.data(), 1, out.data());
    return out;
  };
  const std::vector<float> rounded = output(true);
  const std::vector<float> exact = output(false);
  // The model's own decode step gives the rounded variant exactly.
  std::vector<float> model_out(c.dim);
  int32_t token = g.master_prompt[p];
  std::vector<ChunkRef> ch{{&f.seq, p, &token, 1}};
  lm.model->run_attention(k, ch, x.data(), model_out.data(), f.cache);
  EXPECT_EQ(compare(model_out, rounded).frac_equal, 1.0);
  const Diff spread = compare(exact, rounded);
  std::printf("[%s] decode L%d p297: attention with vs without BF16 probabilities: %s\n",
              g.name.c_str(), k, to_string(spread).c_str());
  EXPECT_GE(spread.rel_l2, 5e-3);
}

INSTANTIATE_TEST_SUITE_P(Sets, GoldenLayers,
                         ::testing::ValuesIn(golden_sets().empty()
                                                 ? std::vector<std::string>{"none"}
                                                 : golden_sets()));

}  // namespace
}  // namespace dsv4::test
