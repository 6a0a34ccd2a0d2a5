// Speculative decoding on the CPU backend, through the real verify and rollback: drafts are
// forced to follow the plain run's continuation with chosen positions perturbed, so full,
// partial and zero acceptance each happen where the test says. A verified step must emit
// exactly the plain run's tokens, its logits at the accepted positions must be the plain
// run's bit for bit, and afterwards every cache store of the sequence (window rings,
// compressed entries, indexer keys, compressor states, the MTP block's ring and hidden
// state) and the page accounting must be what plain decoding leaves. Batched sequences with
// different k, drafts crossing 4- and 128-token boundaries, on both make-tiny presets, with
// either rollback (Rollback: the rerun of the kept tokens, or restoring the rejected stores).
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>

#include "backends/cpu/loader.h"
#include "backends/cpu/runner.h"
#include "core/error.h"
#include "dsv4/engine.h"
#include "model/cache_spec.h"
#include "model/tiny_checkpoint.h"
#include "support/speculation_steps.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

constexpr int kMaxLen = 200;

struct Preset {
  TempDir dir;
  LoadedModel lm;
  explicit Preset(const std::string& name) {
    write_tiny_checkpoint(tiny_preset(name), ExpertFormat::kMxfp4, 42, dir.path(), tiny_init(name));
    lm = load_cpu_model(dir.path());
  }
  std::unique_ptr<CpuRunner> runner(bool spec, int seqs = 4, int page = 4,
                                    Rollback rollback = Rollback::kRerun) const {
    auto r = std::make_unique<CpuRunner>(*lm.model, cache_capacity(lm.config, seqs, kMaxLen, page));
    if (spec) r->enable_speculation(rollback);
    return r;
  }
  int V() const { return lm.config.vocab_size; }
};

Preset& preset(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Preset>> p;
  auto& x = p[name];
  if (!x) x = std::make_unique<Preset>(name);
  return *x;
}

std::vector<int32_t> random_prompt(int n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p{0};
  while (int(p.size()) < n) p.push_back(2 + int32_t(rng() % uint32_t(vocab - 2)));
  return p;
}

// One sequence's plain run: the output and, per output token t, the logits row that
// sampled it (the row of position prompt + t - 1).
struct Plain {
  std::vector<int32_t> out;
  std::vector<std::vector<float>> rows;
};

Plain plain_run(CpuRunner& r, const std::vector<int32_t>& prompt, int n,
                const SamplingParams& params) {
  Plain p;
  const int s = r.open_sequence();
  std::vector<int32_t> next = prompt;
  for (int t = 0; t < n; ++t) {
    SampleSpec spec;
    spec.params = &params;
    spec.index = t;
    StepInput in(s, next);
    in.sample = &spec;
    StepOutput o = r.step({in});
    EXPECT_TRUE(o.errors[0].empty()) << o.errors[0];
    p.out.push_back(o.samples[0].id);
    p.rows.push_back(o.logits);
    next = {o.samples[0].id};
  }
  r.close_sequence(s);
  return p;
}

// A sequence decoded speculatively against its plain run.
struct Spec {
  std::vector<int32_t> prompt;
  SamplingParams params;
  int k = 0;                // drafts per step
  std::set<int> perturbed;  // output indices whose forced draft is wrong
  const Plain* plain = nullptr;
  std::vector<int32_t> drafts_forced;  // per output index
  int seq = -1;
  std::vector<int32_t> out, drafts;
  int64_t drafted = 0, accepted = 0, steps = 0;
};

// Decodes every sequence to its plain run's length, all in one batch per step, and checks
// each step as it goes.
void run_speculative(const Preset& pr, CpuRunner& r, std::vector<Spec>& seqs) {
  const int V = pr.V();
  test::open_forced(r, seqs, V);
  for (bool first = true;; first = false) {
    test::SpecStep<Spec> step = test::next_step(seqs, first);
    std::vector<StepInput>& ins = step.ins;
    std::vector<Spec*>& who = step.who;
    if (ins.empty()) break;
    std::vector<int64_t> before;
    for (Spec* s : who) before.push_back(r.length(s->seq));
    StepOutput o = r.step(ins);
    size_t row = 0;
    for (size_t i = 0; i < who.size(); ++i) {
      Spec& s = *who[i];
      const StepInput& in = ins[i];
      ASSERT_TRUE(o.errors[i].empty()) << o.errors[i];
      const int nt = int(in.tokens.size()), v = in.verify;
      std::vector<int32_t> emitted{o.samples[i].id};
      for (const SampledToken& t : o.more[i]) emitted.push_back(t.id);
      // Accepted drafts: the leading ones that equal the plain continuation (this step's
      // drafts propose output indices out.size(), out.size() + 1, ...).
      int expect = 0;
      while (expect < v && !s.perturbed.count(int(s.out.size()) + expect)) ++expect;
      ASSERT_EQ(int(emitted.size()), expect + 1) << "k " << s.k << " at output " << s.out.size();
      for (size_t j = 0; j < emitted.size(); ++j) {
        const size_t t = s.out.size() + j;
        ASSERT_EQ(emitted[j], s.plain->out[t]) << "output token " << t;
        const float* got = o.logits.data() + (row + size_t(nt - 1 - v) + j) * size_t(V);
        ASSERT_EQ(std::memcmp(got, s.plain->rows[t].data(), size_t(V) * sizeof(float)), 0)
            << "logits of output token " << t << " (k " << s.k << ")";
      }
      EXPECT_EQ(r.length(s.seq), before[i] + (nt - v) + int64_t(emitted.size()) - 1);
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
}

// Every store of sequence `a` in `ra` equals sequence `b`'s in `rb` (both at the same length):
// the window rings' live slots, compressed entries and indexer keys, compressor states,
// and, when both keep it, the MTP block's ring and hidden state.
void expect_same_cache(CpuRunner& ra, int a, CpuRunner& rb, int b, bool mtp) {
  const ModelConfig& c = ra.config();
  const SequenceCache& sa = ra.sequence(a);
  const SequenceCache& sb = rb.sequence(b);
  ASSERT_EQ(sa.tokens, sb.tokens);
  const int64_t len = sa.tokens;
  HostCache& ca = ra.cache();
  HostCache& cb = rb.cache();
  const KvEntryLayout& kv = ca.kv_layout();
  const IndexKeyLayout& ix = ca.index_layout();
  auto same = [](EntryRef x, EntryRef y, int data, int scales) {
    return std::memcmp(x.data, y.data, size_t(data)) == 0 &&
           std::memcmp(x.scales, y.scales, size_t(scales)) == 0;
  };
  for (int bl = 0; bl < c.n_layers; ++bl) {
    for (int64_t p = std::max<int64_t>(0, len - c.window_size); p < len; ++p)
      ASSERT_TRUE(same(ca.window_slot(bl, sa, p), cb.window_slot(bl, sb, p), kv.data_bytes(),
                       kv.scale_bytes()))
          << "block " << bl << " window position " << p;
    const int ratio = c.ratio(bl);
    if (ratio == 0) continue;
    for (int64_t i = 0; i < len / ratio; ++i) {
      ASSERT_TRUE(same(ca.compressed(bl, sa, i), cb.compressed(bl, sb, i), kv.data_bytes(),
                       kv.scale_bytes()))
          << "block " << bl << " compressed entry " << i;
      if (ratio == 4) {
        ASSERT_TRUE(same(ca.index_key(bl, sa, i), cb.index_key(bl, sb, i), ix.data_bytes(),
                         ix.scale_bytes()))
            << "block " << bl << " indexer key " << i;
      }
    }
    const int64_t fl = ca.main_state_layout(bl).floats();
    ASSERT_EQ(std::memcmp(ca.main_state(bl, sa.state_slot), cb.main_state(bl, sb.state_slot),
                          size_t(fl) * sizeof(float)),
              0)
        << "block " << bl << " compressor state";
    if (ratio == 4) {
      ASSERT_EQ(std::memcmp(ca.index_state(bl, sa.state_slot), cb.index_state(bl, sb.state_slot),
                            size_t(ca.index_state_layout().floats()) * sizeof(float)),
                0)
          << "block " << bl << " indexer compressor state";
    }
  }
  if (!mtp) return;
  ASSERT_EQ(sa.mtp_tokens, len - 1);
  ASSERT_EQ(sb.mtp_tokens, len - 1);
  const int m = c.n_layers;
  for (int64_t p = std::max<int64_t>(0, len - 1 - c.window_size); p < len - 1; ++p)
    ASSERT_TRUE(
        same(ca.window_slot(m, sa, p), cb.window_slot(m, sb, p), kv.data_bytes(), kv.scale_bytes()))
        << "MTP window position " << p;
  ASSERT_EQ(std::memcmp(ca.mtp_hidden(sa.state_slot), cb.mtp_hidden(sb.state_slot),
                        size_t(c.hc_mult) * c.dim * sizeof(float)),
            0);
}

class Speculative : public ::testing::TestWithParam<std::string> {};

// Full, zero and partial acceptance for k = 1, 2, 3, batched, across the 128-token window
// edge and several 4-token compression boundaries, at temperature 0 and above.
TEST_P(Speculative, EqualsPlainDecodingBitForBit) {
  const Preset& pr = preset(GetParam());
  const int V = pr.V(), N = 22;
  SamplingParams greedy, warm;
  warm.temperature = 0.9f;
  warm.top_k = 50;
  warm.seed = 5;
  // Prompts of 117 and 123 tokens: decoding runs positions 116..138 and 122..144, over the
  // 128-token edge (the first HCA entry, the window's wrap) and six CSA boundaries.
  struct Def {
    int len;
    const SamplingParams* params;
    int k;
    std::set<int> perturbed;
  };
  const std::vector<std::vector<Def>> batches = {
      // Full acceptance; all rejected; partial at chosen places, with different k batched.
      {{117, &greedy, 3, {}}, {123, &greedy, 1, {}}},
      {{117, &greedy, 3, {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11,
                          12, 13, 14, 15, 16, 17, 18, 19, 20, 21}},
       {123, &warm, 2, {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11,
                        12, 13, 14, 15, 16, 17, 18, 19, 20, 21}}},
      {{117, &greedy, 3, {2, 7, 9, 13, 14, 20}},
       {123, &warm, 3, {3, 4, 11, 16}},
       {120, &greedy, 2, {5, 6, 12}},
       {126, &greedy, 1, {4, 8, 9, 17}}},
  };
  std::unique_ptr<CpuRunner> plain_r = pr.runner(false), ref = pr.runner(true);
  std::map<std::pair<int, const SamplingParams*>, Plain> plains;
  for (const auto& batch : batches)
    for (const Def& d : batch) {
      auto key = std::make_pair(d.len, d.params);
      if (plains.count(key)) continue;
      const std::vector<int32_t> prompt = random_prompt(d.len, V, unsigned(d.len));
      plains[key] = plain_run(*plain_r, prompt, N, *d.params);
      // The MTP block kept current changes nothing of the main model's.
      Plain again = plain_run(*ref, prompt, N, *d.params);
      ASSERT_EQ(again.out, plains[key].out);
      for (int t = 0; t < N; ++t)
        ASSERT_EQ(std::memcmp(again.rows[t].data(), plains[key].rows[t].data(), V * 4), 0);
    }
  // Both rollbacks: the rerun of the kept tokens, and putting back only what the rejected
  // positions changed (which must leave the same bytes on the CPU).
  for (const Rollback mode : {Rollback::kRerun, Rollback::kRestore})
    for (const auto& batch : batches) {
      std::unique_ptr<CpuRunner> r = pr.runner(true, 4, 4, mode);
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
      run_speculative(pr, *r, seqs);
      if (HasFatalFailure()) return;
      for (Spec& s : seqs) {
        EXPECT_EQ(s.out, s.plain->out);
        std::printf("  [%s, %s] prompt %zu k %d: %lld verify steps, %lld/%lld drafts accepted\n",
                    GetParam().c_str(), mode_name, s.prompt.size(), s.k, (long long)s.steps,
                    (long long)s.accepted, (long long)s.drafted);
        // The stores against a plain run to the same length on a runner keeping the MTP block.
        const int q = ref->open_sequence();
        std::vector<int32_t> toks = s.prompt;
        toks.insert(toks.end(), s.out.begin(), s.out.end() - 1);
        ref->step({{q, toks}});
        expect_same_cache(*r, s.seq, *ref, q, true);
        // Page accounting: what the plain run's sequence holds.
        for (PageKind k : {PageKind::kC4, PageKind::kC128})
          EXPECT_EQ(r->sequence(s.seq).pages[int(k)].size(), ref->sequence(q).pages[int(k)].size());
        ref->close_sequence(q);
      }
      // Every page back when the sequences close (none leaked by a rollback).
      for (Spec& s : seqs) r->close_sequence(s.seq);
      const CacheUsage u = r->usage();
      for (int k = 0; k < kNumPageKinds; ++k) EXPECT_EQ(u.pages_used[k], 0);
    }
}

// Rollback::kRestore's copies of a verify's span fit the copy list the CUDA rollback plans
// (rollback_span_bound, one segment per store range before any merging): every start position
// modulo 4, every span of 1 to kMaxDraftTokens + 1 positions, every kept count.
TEST_P(Speculative, RestoreCopiesFitTheRollbackBound) {
  const Preset& pr = preset(GetParam());
  std::unique_ptr<CpuRunner> r = pr.runner(true);
  const int q = r->open_sequence();
  r->step({{q, random_prompt(16, pr.V(), 3)}});
  const ModelConfig& c = r->config();
  int64_t most = 0;
  for (int64_t start = 0; start + kMaxDraftTokens + 1 <= 16; ++start)
    for (int n = 1; n <= kMaxDraftTokens + 1; ++n)
      for (int kept = 1; kept <= n; ++kept) {
        int64_t ranges = 0;
        for_each_rejected_store(r->cache(), c, r->sequence(q), CacheSpan{0, c.n_layers, start, n},
                                kept, [&](uint8_t*, int64_t) { ++ranges; });
        EXPECT_LE(ranges, rollback_span_bound(c, 0, c.n_layers, n).segments)
            << "start " << start << " n " << n << " kept " << kept;
        most = std::max(most, ranges);
      }
  EXPECT_GT(most, 0);
}

// The MTP block's own drafts (no override): random weights accept next to nothing, but the
// tokens are still the plain run's and the drafting's ring writes are rolled back.
TEST_P(Speculative, MtpDraftsKeepPlainOutput) {
  const Preset& pr = preset(GetParam());
  const int V = pr.V();
  SamplingParams greedy;
  const std::vector<int32_t> prompt = random_prompt(61, V, 3);
  std::unique_ptr<CpuRunner> ref = pr.runner(true);
  const Plain plain = plain_run(*ref, prompt, 12, greedy);
  std::unique_ptr<CpuRunner> r = pr.runner(true);
  const int sq = r->open_sequence();
  std::vector<int32_t> out, drafts, next = prompt;
  while (int(out.size()) < 12) {
    SampleSpec sp;
    sp.params = &greedy;
    sp.index = int64_t(out.size());
    StepInput in(sq, next);
    const int d = std::min<int>(int(drafts.size()), 12 - int(out.size()) - 1);
    in.tokens.insert(in.tokens.end(), drafts.begin(), drafts.begin() + d);
    in.verify = d;
    in.draft = 3;
    in.sample = &sp;
    StepOutput o = r->step({in});
    out.push_back(o.samples[0].id);
    for (const SampledToken& t : o.more[0]) out.push_back(t.id);
    drafts = o.drafts[0];
    ASSERT_EQ(drafts.size(), 3u);
    for (int32_t t : drafts) ASSERT_TRUE(t >= 0 && t < V);
    next = {out.back()};
  }
  EXPECT_EQ(out, plain.out);
  const int q = ref->open_sequence();
  std::vector<int32_t> toks = prompt;
  toks.insert(toks.end(), out.begin(), out.end() - 1);
  ref->step({{q, toks}});
  expect_same_cache(*r, sq, *ref, q, true);
}

// Without speculation enabled a verify or draft is refused; bad verify counts are refused
// before anything runs.
TEST_P(Speculative, Refusals) {
  const Preset& pr = preset(GetParam());
  std::unique_ptr<CpuRunner> r = pr.runner(false);
  const int s = r->open_sequence();
  SamplingParams greedy;
  SampleSpec sp;
  sp.params = &greedy;
  StepInput in(s, {0, 5, 6});
  in.sample = &sp;
  in.verify = 1;
  EXPECT_THROW(r->step({in}), Error);
  in.verify = 0;
  in.draft = 1;
  EXPECT_THROW(r->step({in}), Error);
  std::unique_ptr<CpuRunner> on = pr.runner(true);
  const int t = on->open_sequence();
  StepInput bad(t, {0, 5});
  bad.sample = &sp;
  bad.verify = 2;  // needs a token before the drafts
  EXPECT_THROW(on->step({bad}), Error);
  bad.verify = 4;
  EXPECT_THROW(on->step({bad}), Error);
  EXPECT_EQ(on->length(t), 0);
}

// ---- The engine loop with --speculative-tokens: scheduling, caps, metrics ----

struct Req {
  std::vector<int32_t> prompt;
  SamplingOptions s;
  int n = 1;
};

struct Got {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<TokenLogprob>> logprobs;
  std::vector<FinishReason> finish;
};

std::vector<Got> run_engine(Engine& e, const std::vector<Req>& rs) {
  std::map<uint64_t, size_t> index;
  std::vector<Got> res(rs.size());
  for (size_t i = 0; i < rs.size(); ++i) {
    index[e.add_request(rs[i].prompt, rs[i].s, rs[i].n)] = i;
    res[i].tokens.resize(size_t(rs[i].n));
    res[i].logprobs.resize(size_t(rs[i].n));
    res[i].finish.resize(size_t(rs[i].n), FinishReason::kNone);
  }
  for (int steps = 0; e.has_work(); ++steps) {
    if (steps > 5000) {
      ADD_FAILURE() << "engine loop does not finish";
      break;
    }
    for (const RequestOutput& o : e.step()) {
      Got& g = res[index.at(o.request)];
      auto& t = g.tokens[size_t(o.choice)];
      t.insert(t.end(), o.tokens.begin(), o.tokens.end());
      auto& l = g.logprobs[size_t(o.choice)];
      l.insert(l.end(), o.logprobs.begin(), o.logprobs.end());
      if (o.finish != FinishReason::kNone) {
        g.finish[size_t(o.choice)] = o.finish;
        EXPECT_EQ(o.error, "");
      }
    }
  }
  return res;
}

void expect_same(const Got& got, const Got& want, const std::string& what) {
  ASSERT_EQ(got.tokens.size(), want.tokens.size()) << what;
  for (size_t j = 0; j < got.tokens.size(); ++j) {
    EXPECT_EQ(got.tokens[j], want.tokens[j]) << what << " choice " << j;
    EXPECT_EQ(got.finish[j], want.finish[j]) << what << " choice " << j;
    ASSERT_EQ(got.logprobs[j].size(), want.logprobs[j].size()) << what;
    for (size_t k = 0; k < got.logprobs[j].size(); ++k) {
      EXPECT_EQ(got.logprobs[j][k].token, want.logprobs[j][k].token) << what;
      EXPECT_EQ(got.logprobs[j][k].logprob, want.logprobs[j][k].logprob) << what;
      EXPECT_EQ(got.logprobs[j][k].top, want.logprobs[j][k].top) << what;
    }
  }
}

EngineOptions engine_options(const std::string& dir, int spec) {
  EngineOptions o;
  o.model_dir = dir;
  o.page_size = 4;
  o.max_sequences = 6;
  o.max_tokens = 200;
  o.prefix_block = 16;  // snapshots every 64 tokens and at the last multiple of 16
  o.speculative_tokens = spec;
  return o;
}

// What a step of the speculative engine counted, as differences of two stats().
struct SpecCounts {
  int64_t steps, drafted, accepted;
  std::vector<int64_t> per_pos;
};
SpecCounts delta(const EngineStats& a, const EngineStats& b) {
  SpecCounts d{b.spec_drafts - a.spec_drafts,
               b.spec_draft_tokens - a.spec_draft_tokens,
               b.spec_accepted_tokens - a.spec_accepted_tokens,
               {}};
  for (size_t j = 0; j < b.spec_accepted_per_pos.size(); ++j)
    d.per_pos.push_back(b.spec_accepted_per_pos[j] -
                        (j < a.spec_accepted_per_pos.size() ? a.spec_accepted_per_pos[j] : 0));
  return d;
}

TEST(SpeculativeEngine, OutputsEqualPlainDecodingAndCountsAreVllms) {
  const Preset& pr = preset("flash");
  const int V = pr.V();
  std::vector<Req> rs;
  auto add = [&](int len, unsigned seed, int64_t max_new) {
    Req r;
    r.prompt = random_prompt(len, V, seed);
    r.s.max_new_tokens = max_new;
    r.s.stop_at_eos = false;
    r.s.seed = seed;
    rs.push_back(r);
    return &rs.back();
  };
  add(117, 1, 20);              // greedy, drafts forced to the plain output: everything accepted
  add(70, 2, 17);               // greedy, every draft wrong
  Req* warm = add(125, 3, 19);  // sampled with penalties and logprobs, partly accepted
  warm->s.temperature = 0.9f;
  warm->s.top_k = 40;
  warm->s.repetition_penalty = 1.2f;
  warm->s.frequency_penalty = 0.3f;
  warm->s.logprobs = true;
  warm->s.top_logprobs = 2;
  add(33, 4, 9)->s.speculative_tokens = 0;  // opted out
  add(64, 5, 12)->s.speculative_tokens = 1;
  Req* two = add(20, 6, 11);  // n = 2, sampled, the MTP block's own drafts
  two->n = 2;
  two->s.temperature = 1.0f;

  std::unique_ptr<Engine> plain = Engine::open(engine_options(pr.dir.path(), 0));
  std::vector<Got> want;
  for (const Req& r : rs) want.push_back(run_engine(*plain, {r})[0]);
  // Forced drafts from the plain outputs: request 0 all right, 1 all wrong, 2 wrong at a few
  // output indices.
  rs[0].s.forced_drafts = want[0].tokens[0];
  rs[1].s.forced_drafts = want[1].tokens[0];
  for (int32_t& t : rs[1].s.forced_drafts) t = (t + 1) % V;
  rs[2].s.forced_drafts = want[2].tokens[0];
  for (int t : {3, 4, 9, 14}) rs[2].s.forced_drafts[size_t(t)] ^= 1;
  rs[4].s.forced_drafts = want[4].tokens[0];

  std::unique_ptr<Engine> e = Engine::open(engine_options(pr.dir.path(), 3));
  // Alone, where the counts are known exactly.
  EngineStats s0 = e->stats();
  ASSERT_EQ(s0.spec_accepted_per_pos.size(), 3u);
  expect_same(run_engine(*e, {rs[0]})[0], want[0], "all accepted");
  EngineStats s1 = e->stats();
  SpecCounts d = delta(s0, s1);
  // 20 tokens: the first from the prefill, then verifies of 3 drafts emitting 4 tokens
  // (outputs 1, 5, 9, 13 -> 17), the last of 2 drafts (room for 3 tokens).
  EXPECT_EQ(d.steps, 5);
  EXPECT_EQ(d.drafted, 14);
  EXPECT_EQ(d.accepted, 14);
  EXPECT_EQ(d.per_pos, (std::vector<int64_t>{5, 5, 4}));
  EXPECT_EQ(s1.generation_tokens - s0.generation_tokens, 20);
  expect_same(run_engine(*e, {rs[1]})[0], want[1], "all rejected");
  EngineStats s2 = e->stats();
  d = delta(s1, s2);
  // 17 tokens, one per step: after output t (1..15) min(3, 16 - t) drafts are verified,
  // none taken; the last step has no room for drafts.
  EXPECT_EQ(d.steps, 15);
  EXPECT_EQ(d.drafted, 42);
  EXPECT_EQ(d.accepted, 0);
  EXPECT_EQ(d.per_pos, (std::vector<int64_t>{0, 0, 0}));
  expect_same(run_engine(*e, {rs[3]})[0], want[3], "opted out");
  EXPECT_EQ(delta(s2, e->stats()).steps, 0);
  // A resend of request 0 resumes from a prefix-cache snapshot (its MTP state included).
  {
    const EngineStats a = e->stats();
    expect_same(run_engine(*e, {rs[0]})[0], want[0], "resend");
    EXPECT_GT(e->stats().prefix_hits - a.prefix_hits, 0);
  }
  // Everything at once, batched with different k and acceptance.
  const EngineStats a = e->stats();
  const std::vector<Got> got = run_engine(*e, rs);
  for (size_t i = 0; i < rs.size(); ++i)
    expect_same(got[i], want[i], "request " + std::to_string(i));
  d = delta(a, e->stats());
  EXPECT_GT(d.accepted, 0);
  EXPECT_LT(d.accepted, d.drafted);
  int64_t sum = 0;
  for (size_t j = 0; j < d.per_pos.size(); ++j) {
    sum += d.per_pos[j];
    if (j > 0) {
      EXPECT_LE(d.per_pos[j], d.per_pos[j - 1]);
    }
  }
  EXPECT_EQ(sum, d.accepted);
  EXPECT_EQ(e->stats().running, 0);
  EXPECT_EQ(e->stats().cache_usage, 0.0);
}

// Preemption under a small cache drops a choice's drafts with its sequence; readmitted, it
// recomputes and drafts again. Every output is still the plain run's.
TEST(SpeculativeEngine, PreemptionUnderASmallCacheKeepsPlainOutputs) {
  const Preset& pr = preset("flash");
  const ModelConfig& cfg = pr.lm.config;
  std::unique_ptr<Engine> plain = Engine::open(engine_options(pr.dir.path(), 0));
  std::vector<Req> rs;
  std::vector<Got> want;
  for (int i = 0; i < 5; ++i) {
    Req r;
    r.prompt = random_prompt(20 + 12 * i, pr.V(), 40 + unsigned(i));
    r.s.max_new_tokens = 24;
    r.s.stop_at_eos = false;
    r.s.seed = uint64_t(i);
    r.s.temperature = i % 2 ? 0.8f : 0.0f;
    rs.push_back(r);
    want.push_back(run_engine(*plain, {r})[0]);
    if (i < 3) rs.back().s.forced_drafts = want.back().tokens[0];  // mostly accepted
  }
  // Window rings for 6 sequences, compressed pages for about two of them.
  CacheConfig small = cache_capacity(cfg, 6, 96, 4);
  const CacheConfig few = cache_capacity(cfg, 3, 96, 4);
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) small.pages[int(k)] = few.pages[int(k)];
  EngineOptions o = engine_options(pr.dir.path(), 3);
  o.max_tokens = 96;
  o.cache_bytes = cache_bytes(cfg, small);
  o.prefix_snapshots = 0;
  std::unique_ptr<Engine> e = Engine::open(o);
  const std::vector<Got> got = run_engine(*e, rs);
  for (size_t i = 0; i < rs.size(); ++i)
    expect_same(got[i], want[i], "request " + std::to_string(i));
  EXPECT_GT(e->stats().preemptions, 0);
  EXPECT_GT(e->stats().spec_accepted_tokens, 0);
  EXPECT_EQ(e->stats().cache_usage, 0.0);
}

TEST(SpeculativeEngine, BadOptionsAreErrors) {
  const Preset& pr = preset("flash");
  EXPECT_THROW(Engine::open(engine_options(pr.dir.path(), 4)), Error);
  std::unique_ptr<Engine> e = Engine::open(engine_options(pr.dir.path(), 2));
  SamplingOptions s;
  s.speculative_tokens = 4;
  EXPECT_THROW(e->add_request({0, 5}, s), Error);
  s.speculative_tokens = -2;
  EXPECT_THROW(e->add_request({0, 5}, s), Error);
}

INSTANTIATE_TEST_SUITE_P(Presets, Speculative, ::testing::Values("flash", "pro"));

}  // namespace
}  // namespace dsv4::test
