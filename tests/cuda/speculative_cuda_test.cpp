// Speculative decoding on the CUDA backend against plain CUDA decoding, through the real
// verify (k + 1 tokens per sequence through every kernel), device-side rollback and MTP
// drafting. Drafts are forced to follow the plain run's continuation with chosen positions
// perturbed (the CPU suite's scenarios, tests/speculative_test.cpp): full, zero and partial
// acceptance, k = 1-3 batched, prompts of 117-126 tokens so decoding crosses the 128-token
// window edge (and the first HCA entry) and several 4-token CSA boundaries.
//
// What is exact and what is held to a tolerance: the CUDA kernels are not shape-invariant (a
// verify's k + 1 rows per sequence take other GEMM and attention paths than one row), so
//  - tokens must equal plain decoding's, except where the plain run's choice was a near tie
//    (greedy: top-2 logit gap < 0.1, the golden README's rule; sampled: the same gap in the
//    exponential race's keys, divided by the temperature) — from there the sequence is no
//    longer compared;
//  - the verify's logits rows at emitted positions are held to the end-to-end tolerance;
//  - with every draft rejected, the rollback restores the saved bytes and the kept token runs
//    again as one row per sequence, which is exactly a plain decode step of the same batch:
//    every cache store (window rings, compressed entries, indexer keys, compressor states, the
//    MTP ring and state) must then equal plain decoding's byte for byte (the kernels are
//    deterministic run to run; this is what proves the rollback exact);
//  - plain decode steps keep their CUDA graphs with speculation enabled: logits bit-identical
//    to a runner without speculation;
//  - verify steps, the rerun of kept tokens and the MTP block's steps run as CUDA graphs: every
//    returned logits row, sample, draft and every cache store equal an eager runner's (launches
//    sized by the same bucketed bound) byte for byte, step after step, for full, partial and
//    zero acceptance and mixed k in one batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <utility>

#include "backends/cpu/host_cache.h"
#include "core/error.h"
#include "cuda/engine_test_support.h"
#include "model/cache_spec.h"
#include "model/tiny_checkpoint.h"
#include "support/speculation_steps.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

constexpr int kMaxLen = 200;
constexpr int kSeqs = 4;

struct Preset {
  TempDir dir;
  std::unique_ptr<CudaStack> stack;  // the model; its own runner is unused
  explicit Preset(const std::string& name) {
    write_tiny_checkpoint(tiny_preset(name), ExpertFormat::kMxfp4, 42, dir.path(), tiny_init(name));
    CudaStackOptions o;
    o.max_seqs = kSeqs;
    o.max_context = 256;
    o.page_size = 4;
    o.max_step_tokens = 512;  // a batch's prompts prefill in one step
    stack = open_cuda_stack(dir.path(), o);
  }
  int V() const { return stack->V(); }
  std::unique_ptr<CudaRunner> runner(bool spec, bool graphs = false,
                                     Rollback rollback = Rollback::kRerun) const {
    CudaRunnerOptions ro;
    ro.cuda_graphs = graphs;
    return runner(spec, ro, rollback);
  }
  std::unique_ptr<CudaRunner> runner(bool spec, const CudaRunnerOptions& ro,
                                     Rollback rollback = Rollback::kRerun) const {
    auto r = std::make_unique<CudaRunner>(*stack->model,
                                          cache_capacity(stack->config, kSeqs, kMaxLen, 4), ro);
    if (spec) r->enable_speculation(rollback);
    return r;
  }
};

std::vector<int32_t> random_prompt(int n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p{0};
  while (int(p.size()) < n) p.push_back(2 + int32_t(rng() % uint32_t(vocab - 2)));
  return p;
}

// A plain run of a batch: the prompts prefilled together, then one token each per step.
struct Plain {
  std::vector<int32_t> out;
  std::vector<std::vector<float>> rows;  // per output token: the logits row that sampled it
};

std::vector<Plain> plain_batch(CudaRunner& r, const std::vector<std::vector<int32_t>>& prompts,
                               const std::vector<const SamplingParams*>& params, int n,
                               std::vector<int>* seqs_out = nullptr) {
  const int V = r.config().vocab_size;
  std::vector<Plain> res(prompts.size());
  std::vector<int> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) seqs.push_back(r.open_sequence());
  for (int t = 0; t < n; ++t) {
    std::vector<StepInput> ins;
    std::vector<SampleSpec> specs(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      specs[i].params = params[i];
      specs[i].index = t;
      StepInput in(seqs[i], t == 0 ? prompts[i] : std::vector<int32_t>{res[i].out.back()});
      in.sample = &specs[i];
      ins.push_back(std::move(in));
    }
    const StepOutput o = r.step(ins);
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_TRUE(o.errors[i].empty()) << o.errors[i];
      res[i].out.push_back(o.samples[i].id);
      res[i].rows.emplace_back(o.logits.begin() + long(i * V),
                               o.logits.begin() + long((i + 1) * V));
    }
  }
  if (seqs_out)
    *seqs_out = seqs;
  else
    for (int s : seqs) r.close_sequence(s);
  return res;
}

// Whether the plain run's choice `want` over `got` in `row` was a near tie: greedy, their
// logits within 0.1; sampled, their exponential-race keys (logit / T - log(-log u)) within
// 0.1 / T.
bool near_tie(const std::vector<float>& row, int32_t want, int32_t got, const SamplingParams& p,
              int64_t index) {
  if (got < 0 || got >= int32_t(row.size())) return false;
  if (p.temperature == 0) return std::fabs(row[size_t(want)] - row[size_t(got)]) < 0.1;
  auto key = [&](int32_t t) {
    return double(row[size_t(t)]) / p.temperature -
           std::log(-std::log(sample_uniform(p.seed, index, t)));
  };
  return std::fabs(key(want) - key(got)) < 0.1 / p.temperature;
}

struct Spec {
  std::vector<int32_t> prompt;
  SamplingParams params;
  int k = 0;
  std::set<int> perturbed;  // output indices whose forced draft is wrong
  const Plain* plain = nullptr;
  std::vector<int32_t> drafts_forced;
  int seq = -1;
  std::vector<int32_t> out, drafts;
  int64_t drafted = 0, accepted = 0, steps = 0;
  int diverged = -1;                // output index of an excused near-tie divergence
  std::vector<float> ours, theirs;  // compared logits rows
};

// Decodes every sequence to its plain run's length, one batch per step, checking as it goes.
void run_speculative(CudaRunner& r, std::vector<Spec>& seqs) {
  const int V = r.config().vocab_size;
  test::open_forced(r, seqs, V);
  for (bool first = true;; first = false) {
    test::SpecStep<Spec> step = test::next_step(seqs, first);
    std::vector<StepInput>& ins = step.ins;
    std::vector<Spec*>& who = step.who;
    if (ins.empty()) break;
    std::vector<int64_t> before;
    for (Spec* s : who) before.push_back(r.length(s->seq));
    const StepOutput o = r.step(ins);
    size_t row = 0;
    for (size_t i = 0; i < who.size(); ++i) {
      Spec& s = *who[i];
      const StepInput& in = ins[i];
      ASSERT_TRUE(o.errors[i].empty()) << o.errors[i];
      const int nt = int(in.tokens.size()), v = in.verify;
      std::vector<int32_t> emitted{o.samples[i].id};
      for (const SampledToken& t : o.more[i]) emitted.push_back(t.id);
      ASSERT_LE(int(emitted.size()), v + 1);
      EXPECT_EQ(r.length(s.seq), before[i] + (nt - v) + int64_t(emitted.size()) - 1);
      for (size_t j = 0; j < emitted.size() && s.diverged < 0; ++j) {
        const size_t t = s.out.size() + j;
        const float* got = o.logits.data() + (row + size_t(nt - 1 - v) + j) * size_t(V);
        s.ours.insert(s.ours.end(), got, got + V);
        s.theirs.insert(s.theirs.end(), s.plain->rows[t].begin(), s.plain->rows[t].end());
        if (emitted[j] == s.plain->out[t]) continue;
        ASSERT_TRUE(near_tie(s.plain->rows[t], s.plain->out[t], emitted[j], s.params, int64_t(t)))
            << "output token " << t << ": " << emitted[j] << ", plain decoding " << s.plain->out[t]
            << " (k " << s.k << ", not a near tie)";
        std::printf(
            "    prompt %zu k %d: near tie at output %zu (%d vs plain %d), not compared "
            "further\n",
            s.prompt.size(), s.k, t, emitted[j], s.plain->out[t]);
        s.diverged = int(t);
      }
      if (s.diverged < 0) {
        // Accepted drafts: the leading ones that equal the plain continuation.
        int expect = 0;
        while (expect < v && !s.perturbed.count(int(s.out.size()) + expect)) ++expect;
        EXPECT_EQ(int(emitted.size()), expect + 1) << "k " << s.k << " at output " << s.out.size();
      }
      s.drafted += v;
      s.accepted += int64_t(emitted.size()) - 1;
      s.steps += v > 0;
      s.out.insert(s.out.end(), emitted.begin(), emitted.end());
      s.drafts = o.drafts[i];
      ASSERT_EQ(int(s.drafts.size()), s.k);
      for (int j = 0; j < s.k; ++j) {
        const size_t t = s.out.size() + size_t(j);
        if (t < s.drafts_forced.size()) {
          EXPECT_EQ(s.drafts[size_t(j)], s.drafts_forced[t]);
        }
      }
      row += size_t(nt);
    }
  }
  // Emitting past the plain run's length is impossible (d above), so the lengths match.
  for (Spec& s : seqs) {
    if (s.diverged < 0) {
      EXPECT_EQ(s.out, s.plain->out);
    }
  }
}

// Blocks [0, blocks) of sequence `sa` in `ha` equal those of `sb` in `hb` byte for byte: the
// live window slots of the first `len` positions (`mtp_len` in MTP blocks), the compressed
// entries and indexer keys they completed, the compressor states.
void expect_same_stores(const ModelConfig& c, HostCache& ha, const SequenceCache& sa, HostCache& hb,
                        const SequenceCache& sb, int64_t len, int64_t mtp_len, int blocks) {
  const KvEntryLayout& kv = ha.kv_layout();
  const IndexKeyLayout& ix = ha.index_layout();
  auto same = [](EntryRef x, EntryRef y, int data, int scales) {
    return std::memcmp(x.data, y.data, size_t(data)) == 0 &&
           std::memcmp(x.scales, y.scales, size_t(scales)) == 0;
  };
  for (int bl = 0; bl < blocks; ++bl) {
    const bool mtp = bl >= c.n_layers;
    const int64_t end = mtp ? mtp_len : len;
    for (int64_t p = std::max<int64_t>(0, end - c.window_size); p < end; ++p)
      ASSERT_TRUE(same(ha.window_slot(bl, sa, p), hb.window_slot(bl, sb, p), kv.data_bytes(),
                       kv.scale_bytes()))
          << "block " << bl << " window position " << p;
    const int ratio = c.ratio(bl);
    if (ratio == 0) continue;
    for (int64_t i = 0; i < end / ratio; ++i) {
      ASSERT_TRUE(same(ha.compressed(bl, sa, i), hb.compressed(bl, sb, i), kv.data_bytes(),
                       kv.scale_bytes()))
          << "block " << bl << " compressed entry " << i;
      if (ratio == 4) {
        ASSERT_TRUE(same(ha.index_key(bl, sa, i), hb.index_key(bl, sb, i), ix.data_bytes(),
                         ix.scale_bytes()))
            << "block " << bl << " indexer key " << i;
      }
    }
    ASSERT_EQ(std::memcmp(ha.main_state(bl, sa.state_slot), hb.main_state(bl, sb.state_slot),
                          size_t(ha.main_state_layout(bl).floats()) * 4),
              0)
        << "block " << bl << " compressor state";
    if (ratio == 4) {
      ASSERT_EQ(std::memcmp(ha.index_state(bl, sa.state_slot), hb.index_state(bl, sb.state_slot),
                            size_t(ha.index_state_layout().floats()) * 4),
                0)
          << "block " << bl << " indexer compressor state";
    }
  }
}

// Every store of sequence `a` in `ra` equals sequence `b`'s in `rb` byte for byte (the live
// window slots, compressed entries, indexer keys, compressor states, the MTP ring and state).
void expect_same_cache(CudaRunner& ra, int a, CudaRunner& rb, int b) {
  const ModelConfig& c = ra.config();
  const SequenceCache& sa = ra.sequence(a);
  const SequenceCache& sb = rb.sequence(b);
  ASSERT_EQ(sa.tokens, sb.tokens);
  ASSERT_EQ(sa.mtp_tokens, sb.mtp_tokens);
  HostCache ha(c, ra.cache().config()), hb(c, rb.cache().config());
  ra.cache().download(ha);
  rb.cache().download(hb);
  expect_same_stores(c, ha, sa, hb, sb, sa.tokens, sa.mtp_tokens, c.num_blocks());
  if (::testing::Test::HasFatalFailure()) return;
  const size_t hbytes = size_t(c.hc_mult) * c.dim * 2;
  std::vector<uint8_t> ma(hbytes), mb(hbytes);
  DSV4_CUDA_CHECK(
      cudaMemcpy(ma.data(), ra.cache().mtp_hidden(sa.state_slot), hbytes, cudaMemcpyDeviceToHost));
  DSV4_CUDA_CHECK(
      cudaMemcpy(mb.data(), rb.cache().mtp_hidden(sb.state_slot), hbytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(ma, mb) << "MTP state";
}

class SpeculativeCuda : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { DSV4_SKIP_WITHOUT_GPU(); }
  static Preset& preset() {
    static std::map<std::string, std::unique_ptr<Preset>> p;
    auto& q = p[GetParam()];
    if (!q) q = std::make_unique<Preset>(GetParam());
    return *q;
  }
};

std::set<int> all_outputs(int n) {
  std::set<int> s;
  for (int t = 1; t < n; ++t) s.insert(t);
  return s;
}

// Full, zero and partial acceptance for k = 1, 2, 3, batched, at temperature 0 and above,
// against each sequence's plain run alone.
TEST_P(SpeculativeCuda, EqualsPlainDecoding) {
  Preset& pr = preset();
  const int V = pr.V(), N = 22;
  SamplingParams greedy, warm;
  warm.temperature = 0.9f;
  warm.top_k = 50;
  warm.seed = 5;
  struct Def {
    int len;
    const SamplingParams* params;
    int k;
    std::set<int> perturbed;
  };
  const std::vector<std::vector<Def>> batches = {
      {{117, &greedy, 3, {}}, {123, &greedy, 1, {}}},
      {{117, &greedy, 3, all_outputs(N)}, {123, &warm, 2, all_outputs(N)}},
      {{117, &greedy, 3, {2, 7, 9, 13, 14, 20}},
       {123, &warm, 3, {3, 4, 11, 16}},
       {120, &greedy, 2, {5, 6, 12}},
       {126, &greedy, 1, {4, 8, 9, 17}}},
  };
  std::unique_ptr<CudaRunner> plain_r = pr.runner(false);
  std::map<std::pair<int, const SamplingParams*>, Plain> plains;
  for (const auto& batch : batches)
    for (const Def& d : batch) {
      const auto key = std::make_pair(d.len, d.params);
      if (!plains.count(key))
        plains[key] =
            plain_batch(*plain_r, {random_prompt(d.len, V, unsigned(d.len))}, {d.params}, N)[0];
    }
  // Eagerly, then as the engine runs it: CUDA graphs with the default batch sizes (steps of 3
  // sequences, e.g. chained drafts of mixed k, padded to 4 with scratch rows).
  // Both rollbacks (Rollback, model/runner.h).
  int64_t padded = 0, shaped = 0;
  for (const Rollback mode : {Rollback::kRerun, Rollback::kRestore})
    for (bool graphs : {false, true})
      for (const auto& batch : batches) {
        std::unique_ptr<CudaRunner> r = pr.runner(true, graphs, mode);
        const char* mode_name = mode == Rollback::kRerun ? "rerun" : "restore";
        SCOPED_TRACE(mode_name);
        std::vector<Spec> seqs;
        for (const Def& d : batch) {
          Spec s;
          s.prompt = random_prompt(d.len, V, unsigned(d.len));
          s.params = *d.params;
          s.k = d.k;
          s.perturbed = d.perturbed;
          s.plain = &plains.at({d.len, d.params});
          seqs.push_back(std::move(s));
        }
        run_speculative(*r, seqs);
        if (HasFatalFailure()) return;
        padded += r->padded_steps();
        shaped += r->shaped_graph_replays();
        for (Spec& s : seqs) {
          std::printf(
              "  [%s, %s%s] prompt %zu k %d: %lld verify steps, %lld/%lld drafts accepted\n",
              GetParam().c_str(), mode_name, graphs ? ", graphs" : "", s.prompt.size(), s.k,
              (long long)s.steps, (long long)s.accepted, (long long)s.drafted);
          expect_logits_close("prompt " + std::to_string(s.prompt.size()) + " k " +
                                  std::to_string(s.k) + " emitted rows vs plain",
                              s.ours, s.theirs, V);
        }
        // Every page back when the sequences close (none leaked by a rollback).
        for (Spec& s : seqs) r->close_sequence(s.seq);
        const CacheUsage u = r->usage();
        for (int k = 0; k < kNumPageKinds; ++k) EXPECT_EQ(u.pages_used[k], 0);
      }
  EXPECT_GT(padded, 0);  // padded graph steps ran
  EXPECT_GT(shaped, 0);  // verify-shaped graphs replayed
}

// Every draft rejected, k = 1-3 batched: each step's rollback restores the saved bytes and
// reruns one token per sequence, a plain decode step of the same batch, so every store must
// equal plain decoding's (on a runner keeping the MTP block) byte for byte.
TEST_P(SpeculativeCuda, ZeroAcceptanceLeavesPlainDecodingsBytes) {
  Preset& pr = preset();
  const int V = pr.V(), N = 22;
  SamplingParams greedy;
  const std::vector<int> lens = {117, 123, 126}, ks = {3, 1, 2};
  std::vector<std::vector<int32_t>> prompts;
  for (int len : lens) prompts.push_back(random_prompt(len, V, unsigned(len) + 1));
  std::unique_ptr<CudaRunner> ref = pr.runner(true);
  std::vector<int> ref_seqs;
  const std::vector<Plain> plains =
      plain_batch(*ref, prompts, {&greedy, &greedy, &greedy}, N, &ref_seqs);
  std::unique_ptr<CudaRunner> r = pr.runner(true);
  std::vector<Spec> seqs;
  for (size_t i = 0; i < lens.size(); ++i) {
    Spec s;
    s.prompt = prompts[i];
    s.params = greedy;
    s.k = ks[i];
    s.perturbed = all_outputs(N);
    s.plain = &plains[i];
    seqs.push_back(std::move(s));
  }
  run_speculative(*r, seqs);
  if (HasFatalFailure()) return;
  bool tied = false;
  for (const Spec& s : seqs) tied |= s.diverged >= 0;
  if (tied) {
    std::printf("  [%s] a near tie changed a token: the byte comparison does not apply\n",
                GetParam().c_str());
    return;
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(seqs[i].accepted, 0);
    // The plain sequences ran the last token's step too; the speculative ones hold the tokens
    // before the last emitted one as well, plus it: both at prompt + N - 1.
    expect_same_cache(*r, seqs[i].seq, *ref, ref_seqs[size_t(i)]);
  }
}

// The MTP block's own drafts (no override): random weights accept next to nothing, but the
// tokens are still plain decoding's.
TEST_P(SpeculativeCuda, MtpDraftsKeepPlainOutput) {
  Preset& pr = preset();
  const int V = pr.V(), N = 12;
  SamplingParams greedy;
  const std::vector<int32_t> prompt = random_prompt(61, V, 3);
  std::unique_ptr<CudaRunner> plain_r = pr.runner(false);
  const Plain plain = plain_batch(*plain_r, {prompt}, {&greedy}, N)[0];
  std::unique_ptr<CudaRunner> r = pr.runner(true);
  const int sq = r->open_sequence();
  std::vector<int32_t> out, drafts, next = prompt;
  while (int(out.size()) < N) {
    SampleSpec sp;
    sp.params = &greedy;
    sp.index = int64_t(out.size());
    StepInput in(sq, next);
    const int d = std::min<int>(int(drafts.size()), N - int(out.size()) - 1);
    in.tokens.insert(in.tokens.end(), drafts.begin(), drafts.begin() + d);
    in.verify = d;
    in.draft = 3;
    in.sample = &sp;
    const StepOutput o = r->step({in});
    ASSERT_TRUE(o.errors[0].empty()) << o.errors[0];
    out.push_back(o.samples[0].id);
    for (const SampledToken& t : o.more[0]) out.push_back(t.id);
    drafts = o.drafts[0];
    ASSERT_EQ(drafts.size(), 3u);
    for (int32_t t : drafts) ASSERT_TRUE(t >= 0 && t < V);
    next = {out.back()};
  }
  for (size_t t = 0; t < out.size() && t < plain.out.size(); ++t) {
    if (out[t] == plain.out[t]) continue;
    EXPECT_TRUE(near_tie(plain.rows[t], plain.out[t], out[t], greedy, int64_t(t)))
        << "output " << t;
    break;
  }
}

// With speculation enabled, plain decode steps keep their CUDA graphs (bit-identical logits to
// a runner without speculation); verify steps in between run as their own graphs and later
// decode steps replay again.
TEST_P(SpeculativeCuda, GraphsKeepServingPlainDecoding) {
  Preset& pr = preset();
  const int V = pr.V(), N = 10;
  SamplingParams greedy;
  const std::vector<int32_t> prompt = random_prompt(40, V, 9);
  std::unique_ptr<CudaRunner> plain_r = pr.runner(false, true);
  const Plain plain = plain_batch(*plain_r, {prompt}, {&greedy}, N)[0];
  std::unique_ptr<CudaRunner> r = pr.runner(true, true);
  const Plain again = plain_batch(*r, {prompt}, {&greedy}, N)[0];
  EXPECT_EQ(again.out, plain.out);
  for (int t = 0; t < N; ++t)
    EXPECT_EQ(
        std::memcmp(again.rows[size_t(t)].data(), plain.rows[size_t(t)].data(), size_t(V) * 4), 0)
        << "output " << t;
  EXPECT_GT(r->graph_replays(), 0);
  // Now a sequence that verifies two forced drafts (all right) per step.
  Spec s;
  s.prompt = prompt;
  s.params = greedy;
  s.k = 2;
  s.plain = &plain;
  std::vector<Spec> seqs{s};
  const int64_t replays = r->graph_replays();
  run_speculative(*r, seqs);
  if (HasFatalFailure()) return;
  EXPECT_GT(seqs[0].accepted, 0);
  // Plain decoding after the verifies replays the captured graphs.
  const Plain after = plain_batch(*r, {prompt}, {&greedy}, 4)[0];
  EXPECT_EQ(std::vector<int32_t>(after.out.begin(), after.out.end()),
            std::vector<int32_t>(plain.out.begin(), plain.out.begin() + 4));
  EXPECT_GT(r->graph_replays(), replays);
}

// Verify steps (s_q = k + 1), the reruns of kept tokens and the MTP block's run and chained
// drafts as CUDA graphs against the same steps run eagerly with the graphs' launch bounds
// (bucket_eager_decode): the same bits everywhere — every returned logits row (all rows of
// every verify), samples, accepted tokens, drafts, and after every step every cache store of
// every sequence (window rings, compressed entries, indexer keys, compressor states, the MTP
// ring and state). Mixed k in one batch with full, partial and zero acceptance; prompts of
// 117-126 tokens so drafts cross the 128-token window edge and 4-token CSA boundaries; the
// captured batch sizes are the step sizes (no padding rows: a padded step has other GEMM
// shapes than the eager one), and every shape recurs, so graphs replay many times.
TEST_P(SpeculativeCuda, GraphVerifyStepsEqualEagerBytes) {
  Preset& pr = preset();
  const int V = pr.V(), N = 24;
  SamplingParams greedy;
  struct Def {
    int len, k;
    std::set<int> perturbed;
  };
  const std::vector<std::vector<Def>> batches = {
      {{117, 3, {2, 7, 9, 13, 14, 20}}, {123, 2, all_outputs(N)}, {126, 1, {}}},
      {{117, 3, {}}, {121, 3, {}}, {125, 3, {5, 6, 7, 8, 9, 10, 11, 12, 13}}},
  };
  std::unique_ptr<CudaRunner> plain_r = pr.runner(false);
  CudaRunnerOptions eager_o, graph_o;
  eager_o.cuda_graphs = false;
  eager_o.bucket_eager_decode = true;
  graph_o.cuda_graphs = true;
  graph_o.graph_batch_sizes = {1, 2, 3};
  for (const Rollback mode : {Rollback::kRerun, Rollback::kRestore})
    for (const auto& batch : batches) {
      SCOPED_TRACE(mode == Rollback::kRerun ? "rerun" : "restore");
      std::vector<Plain> plains;
      for (const Def& d : batch)
        plains.push_back(
            plain_batch(*plain_r, {random_prompt(d.len, V, unsigned(d.len) + 7)}, {&greedy}, N)[0]);
      std::unique_ptr<CudaRunner> eager = pr.runner(true, eager_o, mode);
      std::unique_ptr<CudaRunner> graph = pr.runner(true, graph_o, mode);
      std::vector<Spec> se, sg;
      for (size_t i = 0; i < batch.size(); ++i) {
        Spec s;
        s.prompt = random_prompt(batch[i].len, V, unsigned(batch[i].len) + 7);
        s.params = greedy;
        s.k = batch[i].k;
        s.perturbed = batch[i].perturbed;
        s.plain = &plains[i];
        se.push_back(s);
        sg.push_back(s);
      }
      test::open_forced(*eager, se, V);
      test::open_forced(*graph, sg, V);
      int64_t accepted = 0, rejected = 0;
      for (int step = 0;; ++step) {
        test::SpecStep<Spec> ae = test::next_step(se, step == 0);
        test::SpecStep<Spec> ag = test::next_step(sg, step == 0);
        ASSERT_EQ(ae.ins.size(), ag.ins.size()) << "step " << step;
        if (ae.ins.empty()) break;
        const StepOutput oe = eager->step(ae.ins);
        const StepOutput og = graph->step(ag.ins);
        ASSERT_EQ(oe.logits.size(), og.logits.size()) << "step " << step;
        ASSERT_EQ(std::memcmp(oe.logits.data(), og.logits.data(), oe.logits.size() * 4), 0)
            << "step " << step << ": logits differ";
        for (size_t i = 0; i < ae.ins.size(); ++i) {
          ASSERT_TRUE(oe.errors[i].empty() && og.errors[i].empty()) << oe.errors[i] << og.errors[i];
          ASSERT_EQ(oe.samples[i].id, og.samples[i].id) << "step " << step << " seq " << i;
          std::vector<int32_t> me, mg;
          for (const SampledToken& t : oe.more[i]) me.push_back(t.id);
          for (const SampledToken& t : og.more[i]) mg.push_back(t.id);
          ASSERT_EQ(me, mg) << "step " << step << " seq " << i;
          ASSERT_EQ(oe.drafts[i], og.drafts[i]) << "step " << step << " seq " << i;
          accepted += int64_t(me.size());
          rejected += ae.ins[i].verify - int64_t(me.size());
          for (std::vector<Spec>* v : {&se, &sg}) {
            Spec& s = *(v == &se ? ae.who[i] : ag.who[i]);
            s.out.push_back(oe.samples[i].id);
            s.out.insert(s.out.end(), me.begin(), me.end());
            s.drafts = oe.drafts[i];
          }
        }
        for (size_t i = 0; i < se.size(); ++i) {
          expect_same_cache(*eager, se[i].seq, *graph, sg[i].seq);
          if (HasFatalFailure()) {
            ADD_FAILURE() << "step " << step << " sequence " << i;
            return;
          }
        }
      }
      std::printf(
          "  [%s] graph vs eager: %lld drafts accepted, %lld rejected; %d graphs, %lld "
          "replays (%lld of verify-shaped steps)\n",
          GetParam().c_str(), (long long)accepted, (long long)rejected, graph->graphs_captured(),
          (long long)graph->graph_replays(), (long long)graph->shaped_graph_replays());
      EXPECT_GT(accepted, 0);
      EXPECT_EQ(eager->graph_replays(), 0);
      EXPECT_EQ(graph->eager_shaped_steps(), 0);
      EXPECT_EQ(graph->padded_steps(), 0);
      // Steps 3 and later replay: at least the verify of every step from the third on.
      EXPECT_GE(graph->shaped_graph_replays(), 4);
    }
}

// Rollback::kRestore, exactly: the same verify step (the same tokens, so the same forward)
// on two runners with the same history, one made to accept every draft (forced samples), one to
// reject from draft a + 1 on. The rejecting runner's stores must be the accepting runner's with
// exactly the stores for_each_rejected_store names put back to their bytes before the step —
// window rings, compressed entries and indexer keys of the kept length, both compressor states
// of every layer whole — byte for byte. Verifies of k = 3 (and 1) start at every position
// modulo 4 and next to the 128-token edge, with 0, 1 and 2 drafts accepted: a rejected
// position before, at and after a block end of the overlapping states.
TEST_P(SpeculativeCuda, RestorePutsBackExactlyTheRejectedStores) {
  Preset& pr = preset();
  const int V = pr.V();
  const ModelConfig& c = pr.stack->config;
  SamplingParams greedy;
  int cases = 0;
  for (const int len : {117, 118, 119, 120, 126, 127})
    for (const int k : {3, 1})
      for (int accepted = 0; accepted < k; ++accepted) {
        SCOPED_TRACE("prompt " + std::to_string(len) + " k " + std::to_string(k) + " accepted " +
                     std::to_string(accepted));
        const std::vector<int32_t> prompt = random_prompt(len, V, unsigned(len) + 11);
        const int32_t t0 = 7;
        // Output indices 1..k: the drafts; the forced samples of the verify's rows follow them
        // (all accepted) or stop following at draft accepted + 1.
        std::vector<int32_t> drafts(size_t(k) + 2, 0), all(size_t(k) + 2, 0), some;
        for (int j = 1; j <= k + 1; ++j)
          drafts[size_t(j)] = all[size_t(j)] = 2 + (j * 37) % (V - 2);
        some = all;
        some[size_t(accepted) + 1] = (drafts[size_t(accepted) + 1] + 1) % V;
        std::unique_ptr<CudaRunner> ra = pr.runner(true, false, Rollback::kRestore);
        std::unique_ptr<CudaRunner> rr = pr.runner(true, false, Rollback::kRestore);
        int sa = -1, sr = -1;
        std::vector<int32_t> proposed;
        for (CudaRunner* r : {ra.get(), rr.get()}) {
          const int s = r->open_sequence();
          (r == ra.get() ? sa : sr) = s;
          SampleSpec sp;
          sp.params = &greedy;
          sp.forced = t0;
          sp.draft_override = &drafts;
          StepInput in(s, prompt);
          in.draft = k;
          in.sample = &sp;
          const StepOutput o = r->step({in});
          ASSERT_TRUE(o.errors[0].empty()) << o.errors[0];
          ASSERT_EQ(o.samples[0].id, t0);
          proposed = o.drafts[0];
          ASSERT_EQ(proposed, std::vector<int32_t>(drafts.begin() + 1, drafts.begin() + 1 + k));
        }
        HostCache pre(c, rr->cache().config());
        rr->cache().download(pre);
        std::vector<int32_t> tokens{t0};
        tokens.insert(tokens.end(), proposed.begin(), proposed.end());
        for (CudaRunner* r : {ra.get(), rr.get()}) {
          SampleSpec sp;
          sp.params = &greedy;
          sp.index = 1;
          sp.forced_from = r == ra.get() ? &all : &some;
          sp.forced = (*sp.forced_from)[1];  // row 0 (forced_from covers rows 1..)
          StepInput in(r == ra.get() ? sa : sr, tokens);
          in.verify = k;
          in.all_logits = true;
          in.sample = &sp;
          const StepOutput o = r->step({in});
          ASSERT_TRUE(o.errors[0].empty()) << o.errors[0];
          ASSERT_EQ(int(o.more[0].size()), r == ra.get() ? k : accepted);
        }
        const SequenceCache& qa = ra->sequence(sa);
        const SequenceCache& qr = rr->sequence(sr);
        ASSERT_EQ(qa.tokens, int64_t(len) + k + 1);
        ASSERT_EQ(qr.tokens, int64_t(len) + accepted + 1);
        // Same allocations: the rejecting runner's pages are the accepting one's first pages.
        for (int kind = 0; kind < kNumPageKinds; ++kind) {
          ASSERT_LE(qr.pages[kind].size(), qa.pages[kind].size());
          ASSERT_TRUE(
              std::equal(qr.pages[kind].begin(), qr.pages[kind].end(), qa.pages[kind].begin()));
        }
        ASSERT_EQ(qa.state_slot, qr.state_slot);
        // The expectation: the accepting runner's stores, the rejected ones put back from `pre`
        // (addressed through the accepting sequence: the same pages).
        HostCache want(c, ra->cache().config()), got(c, rr->cache().config());
        ra->cache().download(want);
        rr->cache().download(got);
        const CacheSpan span{0, c.n_layers, len, k + 1};
        std::vector<std::pair<uint8_t*, int64_t>> to, from;
        for_each_rejected_store(want, c, qa, span, accepted + 1, [&](uint8_t* p, int64_t n) {
          to.push_back({p, n});
        });
        for_each_rejected_store(pre, c, qa, span, accepted + 1, [&](uint8_t* p, int64_t n) {
          from.push_back({p, n});
        });
        ASSERT_EQ(to.size(), from.size());
        ASSERT_FALSE(to.empty());
        int changed = 0;  // rejected stores the verify changed: the check can fail
        for (size_t i = 0; i < to.size(); ++i) {
          changed += std::memcmp(to[i].first, from[i].first, size_t(to[i].second)) != 0;
          std::memcpy(to[i].first, from[i].first, size_t(to[i].second));
        }
        ASSERT_GT(changed, 0);
        // The rejecting runner's live stores of the layers (its length; the MTP block's
        // positions differ between the two runners and are not part of the span).
        expect_same_stores(c, got, qr, want, qa, qr.tokens, 0, c.n_layers);
        if (HasFatalFailure()) return;
        ++cases;
      }
  std::printf("  [%s] %d verify steps rolled back by restoring, byte for byte\n",
              GetParam().c_str(), cases);
}

// Refusals before anything runs: a verify whose drafts do not follow exactly one token.
TEST_P(SpeculativeCuda, VerifyAfterOneTokenOnly) {
  Preset& pr = preset();
  std::unique_ptr<CudaRunner> r = pr.runner(true);
  const int s = r->open_sequence();
  SamplingParams greedy;
  SampleSpec sp;
  sp.params = &greedy;
  StepInput in(s, {0, 5, 6, 7});
  in.sample = &sp;
  in.verify = 1;
  EXPECT_THROW(r->step({in}), Error);
  EXPECT_EQ(r->length(s), 0);
}

INSTANTIATE_TEST_SUITE_P(Presets, SpeculativeCuda, ::testing::Values("flash", "pro"));

}  // namespace
}  // namespace dsv4::test
