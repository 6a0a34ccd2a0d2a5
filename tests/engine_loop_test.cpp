// The engine loop on the CPU backend: every request's tokens and logprobs are what it gets
// alone, bit for bit, whatever else is in flight (mixed lengths and sampling parameters,
// chunked prefills mixed into decode steps, preemption under a small cache, n > 1 choices
// sharing the prompt's pages with copy-on-write); cancelling frees the cache; bad requests
// are errors before anything runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "dsv4/engine.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/cache_spec.h"
#include "model/model_config.h"
#include "model/tiny_checkpoint.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

struct Case {
  std::vector<int32_t> prompt;
  SamplingOptions s;
  int n = 1;
};

struct Result {
  std::vector<std::vector<int32_t>> tokens;  // per choice
  std::vector<std::vector<TokenLogprob>> logprobs;
  std::vector<FinishReason> finish;
};

class EngineLoopTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kMxfp4, 5, dir_->path(),
                          tiny_init("flash"));
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

  // The prefix cache is on everywhere (block 16: snapshot points every 64 tokens and at the
  // last multiple of 16 before a choice's target), so every test also runs through it.
  static EngineOptions options(int seqs, int64_t cache_bytes = 0, int step_tokens = 0,
                               int snapshots = -1) {
    EngineOptions o;
    o.model_dir = dir_->path();
    o.page_size = 4;
    o.max_sequences = seqs;
    o.max_tokens = 96;
    o.cache_bytes = cache_bytes;
    o.max_step_tokens = step_tokens;
    o.prefix_snapshots = snapshots;
    o.prefix_block = 16;
    return o;
  }

  static std::vector<Case> cases() {
    std::mt19937 rng(11);
    auto prompt = [&](int n) {
      std::vector<int32_t> p{0};
      while (int(p.size()) < n) p.push_back(2 + int32_t(rng() % 2000));
      return p;
    };
    std::vector<Case> c;
    const int lens[] = {1, 3, 17, 40, 5, 63, 9, 30};
    for (int i = 0; i < 8; ++i) {
      Case k;
      k.prompt = prompt(lens[i]);
      k.s.max_new_tokens = 6 + i % 3;
      k.s.stop_at_eos = false;
      k.s.seed = 100 + uint64_t(i);
      switch (i % 4) {
        case 0:
          break;  // greedy
        case 1:
          k.s.temperature = 0.8f;
          k.s.top_k = 20;
          k.s.logprobs = true;
          k.s.top_logprobs = 3;
          break;
        case 2:
          k.s.temperature = 1.2f;
          k.s.top_p = 0.9f;
          k.s.min_p = 0.01f;
          k.s.repetition_penalty = 1.3f;
          k.s.frequency_penalty = 0.5f;
          break;
        case 3:
          k.s.temperature = 1.0f;
          k.s.presence_penalty = 1.0f;
          k.s.logit_bias = {{7, 5.0f}, {9, -3.0f}};
          k.s.logprobs = true;
          break;
      }
      c.push_back(k);
    }
    return c;
  }

  // Runs the cases concurrently (all queued at once) and collects every choice's output.
  static std::vector<Result> run(Engine& e, const std::vector<Case>& cs,
                                 std::vector<uint64_t>* ids_out = nullptr) {
    std::map<uint64_t, size_t> index;
    std::vector<Result> res(cs.size());
    for (size_t i = 0; i < cs.size(); ++i) {
      index[e.add_request(cs[i].prompt, cs[i].s, cs[i].n)] = i;
      res[i].tokens.resize(size_t(cs[i].n));
      res[i].logprobs.resize(size_t(cs[i].n));
      res[i].finish.resize(size_t(cs[i].n), FinishReason::kNone);
    }
    if (ids_out)
      for (auto& [id, i] : index) ids_out->push_back(id);
    int steps = 0;
    while (e.has_work()) {
      EXPECT_LT(++steps, 10000) << "engine loop does not finish";
      if (steps >= 10000) break;
      for (const RequestOutput& o : e.step()) {
        Result& r = res[index.at(o.request)];
        auto& t = r.tokens[size_t(o.choice)];
        t.insert(t.end(), o.tokens.begin(), o.tokens.end());
        auto& l = r.logprobs[size_t(o.choice)];
        l.insert(l.end(), o.logprobs.begin(), o.logprobs.end());
        if (o.finish != FinishReason::kNone) {
          EXPECT_EQ(r.finish[size_t(o.choice)], FinishReason::kNone) << "finished twice";
          r.finish[size_t(o.choice)] = o.finish;
          EXPECT_EQ(o.error.empty(), o.finish != FinishReason::kError) << o.error;
        }
      }
    }
    return res;
  }

  static Result solo(const Case& c) {
    std::unique_ptr<Engine> e = Engine::open(options(4));
    return run(*e, {c})[0];
  }

  static void expect_equal(const Result& got, const Result& want, const std::string& what) {
    ASSERT_EQ(got.tokens.size(), want.tokens.size()) << what;
    for (size_t j = 0; j < got.tokens.size(); ++j) {
      EXPECT_EQ(got.tokens[j], want.tokens[j]) << what << " choice " << j;
      EXPECT_EQ(got.finish[j], want.finish[j]) << what << " choice " << j;
      ASSERT_EQ(got.logprobs[j].size(), want.logprobs[j].size()) << what;
      for (size_t k = 0; k < got.logprobs[j].size(); ++k) {
        EXPECT_EQ(got.logprobs[j][k].token, want.logprobs[j][k].token);
        EXPECT_EQ(got.logprobs[j][k].logprob, want.logprobs[j][k].logprob) << what;
        EXPECT_EQ(got.logprobs[j][k].top, want.logprobs[j][k].top) << what;
      }
    }
  }

  static TempDir* dir_;
};

TempDir* EngineLoopTest::dir_ = nullptr;

TEST_F(EngineLoopTest, ConcurrentRequestsEqualTheirSoloRuns) {
  const std::vector<Case> cs = cases();
  std::vector<Result> want;
  for (const Case& c : cs) want.push_back(solo(c));
  for (const Result& w : want) {
    EXPECT_EQ(w.finish[0], FinishReason::kLength);
    EXPECT_FALSE(w.tokens[0].empty());
  }
  // All at once, and again with a small step budget so prefills are chunked and mixed into
  // decode steps.
  for (int budget : {0, 16}) {
    std::unique_ptr<Engine> e = Engine::open(options(8, 0, budget));
    const std::vector<Result> got = run(*e, cs);
    for (size_t i = 0; i < cs.size(); ++i)
      expect_equal(got[i], want[i],
                   "request " + std::to_string(i) + " budget " + std::to_string(budget));
    EXPECT_EQ(e->stats().running, 0);
    EXPECT_EQ(e->stats().cache_usage, 0.0);
  }
}

TEST_F(EngineLoopTest, PreemptionUnderASmallCacheGivesTheSameOutputs) {
  std::vector<Case> cs = cases();
  for (Case& c : cs) c.s.max_new_tokens = 24;  // decode growth runs the pages out
  std::vector<Result> want;
  for (const Case& c : cs) want.push_back(solo(c));
  // Room for the window rings of 8 sequences but compressed pages for about three of them.
  const ModelConfig cfg = load_model_config(dir_->path() + "/config.json");
  CacheConfig small = cache_capacity(cfg, 8, 96, 4);
  CacheConfig few = cache_capacity(cfg, 3, 96, 4);
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) small.pages[int(k)] = few.pages[int(k)];
  std::unique_ptr<Engine> e = Engine::open(options(8, cache_bytes(cfg, small), 0, 0));
  const std::vector<Result> got = run(*e, cs);
  for (size_t i = 0; i < cs.size(); ++i)
    expect_equal(got[i], want[i], "request " + std::to_string(i));
  EXPECT_GT(e->stats().preemptions, 0);
  EXPECT_EQ(e->stats().cache_usage, 0.0);
}

TEST_F(EngineLoopTest, PreemptionWithThePrefixCacheGivesTheSameOutputs) {
  std::vector<Case> cs = cases();
  for (Case& c : cs) c.s.max_new_tokens = 24;
  std::vector<Result> want;
  for (const Case& c : cs) want.push_back(solo(c));
  // Window rings for 8 running + 4 snapshots, compressed pages for about three sequences:
  // snapshots are evicted first, then running choices preempted.
  const ModelConfig cfg = load_model_config(dir_->path() + "/config.json");
  CacheConfig small = plan_cache(cfg, 8, 96, 4, 0, 4);
  CacheConfig few = cache_capacity(cfg, 3, 96, 4);
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) small.pages[int(k)] = few.pages[int(k)];
  std::unique_ptr<Engine> e = Engine::open(options(8, cache_bytes(cfg, small), 0, 4));
  for (int round = 0; round < 2; ++round) {  // the second round hits the cache
    const std::vector<Result> got = run(*e, cs);
    for (size_t i = 0; i < cs.size(); ++i)
      expect_equal(got[i], want[i],
                   "round " + std::to_string(round) + " request " + std::to_string(i));
  }
  EXPECT_GT(e->stats().preemptions, 0);
  EXPECT_EQ(e->stats().cache_usage, 0.0);
  std::printf("preemptions %lld, prefix hits %lld tokens\n", (long long)e->stats().preemptions,
              (long long)e->stats().prefix_hits);
}

// A resend resumes from the prefix cache and gives the cold run's bits; so does a prompt that
// shares a prefix with an earlier one, and a second turn that extends a first turn's output.
TEST_F(EngineLoopTest, PrefixHitsEqualColdRuns) {
  std::mt19937 rng(17);
  auto tokens = [&](int n) {
    std::vector<int32_t> p;
    while (int(p.size()) < n) p.push_back(2 + int32_t(rng() % 2000));
    return p;
  };
  Case a;
  a.prompt = tokens(70);
  a.prompt[0] = 0;
  a.s.max_new_tokens = 8;
  a.s.stop_at_eos = false;
  a.s.temperature = 0.9f;
  a.s.seed = 3;
  a.s.logprobs = true;
  a.s.top_logprobs = 2;
  Case b = a;  // shares the first 66 tokens
  b.prompt.resize(66);
  for (int32_t t : tokens(14)) b.prompt.push_back(t);
  const Result cold_a = solo(a), cold_b = solo(b);

  std::unique_ptr<Engine> e = Engine::open(options(4));
  auto run_one = [&](const Case& c, int64_t* cached) {
    const uint64_t id = e->add_request(c.prompt, c.s, 1);
    Result r;
    r.tokens.resize(1);
    r.logprobs.resize(1);
    r.finish.resize(1);
    while (e->has_work())
      for (const RequestOutput& o : e->step()) {
        if (o.request != id) continue;
        *cached = o.cached_tokens;
        r.tokens[0].insert(r.tokens[0].end(), o.tokens.begin(), o.tokens.end());
        r.logprobs[0].insert(r.logprobs[0].end(), o.logprobs.begin(), o.logprobs.end());
        if (o.finish != FinishReason::kNone) r.finish[0] = o.finish;
      }
    return r;
  };
  int64_t cached = -1;
  expect_equal(run_one(a, &cached), cold_a, "first");
  EXPECT_EQ(cached, 0);
  // Resend: P = 70, block 16: at least P - 16 cached (the snapshot at 64).
  expect_equal(run_one(a, &cached), cold_a, "resend");
  EXPECT_GE(cached, 70 - 16);
  EXPECT_LT(cached, 70);
  // Shared prefix of 66: the snapshot at 64.
  expect_equal(run_one(b, &cached), cold_b, "shared prefix");
  EXPECT_EQ(cached, 64);
  // Second turn: the first turn's prompt and output, then more. The first turn's tail
  // snapshot (64) is there, and b's decode passed 64 + ... ; at least 64 found.
  Case turn2 = a;
  turn2.prompt.insert(turn2.prompt.end(), cold_a.tokens[0].begin(), cold_a.tokens[0].end());
  for (int32_t t : tokens(5)) turn2.prompt.push_back(t);
  const Result cold_t2 = solo(turn2);
  expect_equal(run_one(turn2, &cached), cold_t2, "second turn");
  EXPECT_GE(cached, 64);
  const EngineStats s = e->stats();
  EXPECT_EQ(s.prefix_queries, 70 + 70 + 80 + int64_t(turn2.prompt.size()));
  EXPECT_EQ(s.prefix_hits, 64 + 64 + cached);
  EXPECT_EQ(s.cache_usage, 0.0);  // what the snapshots hold is evictable
}

TEST_F(EngineLoopTest, ChoicesShareThePromptAndEqualTheirSoloRuns) {
  std::mt19937 rng(5);
  Case c;
  c.prompt = {0};
  while (c.prompt.size() < 30) c.prompt.push_back(2 + int32_t(rng() % 2000));
  c.s.max_new_tokens = 8;
  c.s.stop_at_eos = false;
  // Greedy: every choice is the solo greedy run. 29 shared tokens leave the shared C4 page
  // partly filled, so each choice's first compressed entry copies it.
  c.n = 3;
  const Result g = run(*Engine::open(options(4)), {c})[0];
  Case one = c;
  one.n = 1;
  const Result g1 = solo(one);
  for (int j = 0; j < 3; ++j) EXPECT_EQ(g.tokens[size_t(j)], g1.tokens[0]) << "choice " << j;
  // Sampled: choice 0 draws with the request's seed, so it is the solo run with that seed;
  // the choices differ from each other.
  c.s.temperature = 1.0f;
  c.s.seed = 9;
  one = c;
  one.n = 1;
  const Result s = run(*Engine::open(options(4)), {c})[0];
  EXPECT_EQ(s.tokens[0], solo(one).tokens[0]);
  EXPECT_NE(s.tokens[1], s.tokens[2]);
  // And alongside other requests.
  std::vector<Case> mix = cases();
  mix.insert(mix.begin() + 2, c);
  const std::vector<Result> m = run(*Engine::open(options(12)), mix);
  expect_equal(m[2], s, "n = 3 among others");
}

TEST_F(EngineLoopTest, CancelFreesTheCache) {
  std::unique_ptr<Engine> e = Engine::open(options(4));
  Case c = cases()[5];
  c.s.max_new_tokens = 30;
  const uint64_t a = e->add_request(c.prompt, c.s, 1);
  const uint64_t b = e->add_request(cases()[3].prompt, cases()[3].s, 2);
  e->step();
  e->step();
  EXPECT_GT(e->stats().cache_usage, 0.0);
  e->cancel(a);
  e->cancel(b);
  int aborted = 0;
  while (e->has_work())
    for (const RequestOutput& o : e->step()) aborted += o.finish == FinishReason::kAbort;
  EXPECT_EQ(aborted, 3);
  EXPECT_EQ(e->stats().cache_usage, 0.0);
  EXPECT_EQ(e->stats().running, 0);
  e->cancel(a);  // finished: ignored
  EXPECT_FALSE(e->has_work());
}

TEST_F(EngineLoopTest, StopTokensAndZeroNewTokens) {
  std::unique_ptr<Engine> e = Engine::open(options(2));
  Case c = cases()[2];
  const Result full = run(*e, {c})[0];
  ASSERT_GE(full.tokens[0].size(), 3u);
  c.s.stop_token_ids = {full.tokens[0][2]};
  const Result stopped = run(*e, {c})[0];
  const size_t first =
      size_t(std::find(full.tokens[0].begin(), full.tokens[0].end(), full.tokens[0][2]) -
             full.tokens[0].begin());
  EXPECT_EQ(stopped.tokens[0],
            std::vector<int32_t>(full.tokens[0].begin(), full.tokens[0].begin() + long(first) + 1));
  EXPECT_EQ(stopped.finish[0], FinishReason::kStop);
  c.s.max_new_tokens = 0;
  const Result none = run(*e, {c})[0];
  EXPECT_TRUE(none.tokens[0].empty());
  EXPECT_EQ(none.finish[0], FinishReason::kLength);
}

// A pool planned for exactly the prompt (max_tokens = its length) holds a request for its
// logits and no new tokens, also where one more token would need one more compressed page
// (page_size 4: the C4 store's first page at 4 tokens, its second at 20): no decode follows,
// so admission must not reserve one. The logits equal those of a larger pool.
TEST_F(EngineLoopTest, PromptLogitsFitAPoolPlannedForExactlyThePrompt) {
  std::unique_ptr<Engine> big = Engine::open(options(2));
  for (int len : {3, 19, 20}) {
    EngineOptions o = options(1);
    o.max_tokens = len;
    o.prefix_snapshots = 0;
    std::unique_ptr<Engine> e = Engine::open(o);
    std::vector<int32_t> prompt{0};
    while (int(prompt.size()) < len) prompt.push_back(2 + int32_t(prompt.size() * 37 % 2000));
    EXPECT_EQ(e->prompt_logits(prompt, 0), big->prompt_logits(prompt, 0)) << len << " tokens";
  }
}

TEST_F(EngineLoopTest, ForcedOutputGoesThroughTheSampler) {
  std::unique_ptr<Engine> e = Engine::open(options(2));
  Case c = cases()[1];
  c.s.forced_output = {5, 6, 7};
  c.s.max_new_tokens = 3;
  const Result r = run(*e, {c})[0];
  EXPECT_EQ(r.tokens[0], (std::vector<int32_t>{5, 6, 7}));
  ASSERT_EQ(r.logprobs[0].size(), 3u);
  EXPECT_EQ(r.logprobs[0][1].token, 6);
  EXPECT_LT(r.logprobs[0][1].logprob, 0.0f);
}

TEST_F(EngineLoopTest, PromptLogprobsAreTheLogSoftmaxOfThePromptLogits) {
  std::unique_ptr<Engine> e = Engine::open(options(2, 0, 8));  // chunks of 8: scored in pieces
  const Case c = cases()[3];                                   // 40 tokens
  const std::vector<float> l = e->prompt_logits(c.prompt, 0);
  const int V = e->info().vocab_size;
  SamplingOptions s = c.s;
  s.prompt_logprobs = 2;
  s.max_new_tokens = 1;
  const uint64_t id = e->add_request(c.prompt, s, 1);
  std::vector<TokenLogprob> got;
  int outputs_with = 0;
  while (e->has_work())
    for (const RequestOutput& o : e->step())
      if (o.request == id && !o.prompt_logprobs.empty()) got = o.prompt_logprobs, ++outputs_with;
  EXPECT_EQ(outputs_with, 1);
  ASSERT_EQ(got.size(), c.prompt.size() - 1);
  for (size_t p = 0; p + 1 < c.prompt.size(); ++p) {
    const float* row = l.data() + p * size_t(V);
    double m = row[0], sum = 0;
    for (int v = 0; v < V; ++v) m = std::max(m, double(row[v]));
    for (int v = 0; v < V; ++v) sum += std::exp(double(row[v]) - m);
    const double lse = m + std::log(sum);
    EXPECT_EQ(got[p].token, c.prompt[p + 1]);
    EXPECT_NEAR(got[p].logprob, double(row[c.prompt[p + 1]]) - lse, 1e-5) << p;
    ASSERT_EQ(got[p].top.size(), 2u);
    EXPECT_NEAR(got[p].top[0].second, double(row[got[p].top[0].first]) - lse, 1e-5);
    EXPECT_GE(got[p].top[0].second, got[p].top[1].second);
  }
}

TEST_F(EngineLoopTest, ARequestTheCacheCannotHoldFailsAndOthersGoOn) {
  const ModelConfig cfg = load_model_config(dir_->path() + "/config.json");
  CacheConfig small = cache_capacity(cfg, 2, 96, 4);
  const CacheConfig few = cache_capacity(cfg, 1, 40, 4);
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) small.pages[int(k)] = few.pages[int(k)];
  std::unique_ptr<Engine> e = Engine::open(options(2, cache_bytes(cfg, small), 0, 0));
  std::vector<Case> cs = {cases()[5], cases()[2]};  // 63 tokens: too many; 17: fine
  const std::vector<Result> got = run(*e, cs);
  EXPECT_EQ(got[0].finish[0], FinishReason::kError);
  EXPECT_EQ(got[1].finish[0], FinishReason::kLength);
  expect_equal(got[1], solo(cs[1]), "the other request");
}

// Finite weights that overflow at run time (an embedding row at the BF16 maximum): the
// request that reads it fails naming the position and the first block with non-finite
// output; the others in the same steps are unaffected.
TEST_F(EngineLoopTest, NonFiniteHiddenStatesFailTheRequestAndNameTheBlock) {
  TempDir d;
  write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kMxfp4, 5, d.path(),
                        tiny_init("flash"));
  // Patch embed.weight row 7 in place: safetensors = 8-byte header size, JSON, data.
  const Checkpoint ck(d.path());
  std::string shard;
  for (const auto& f : std::filesystem::directory_iterator(d.path()))
    if (f.path().extension() == ".safetensors" &&
        SafetensorsFile(f.path().string()).contains("embed.weight"))
      shard = f.path().string();
  ASSERT_FALSE(shard.empty());
  {
    std::fstream fs(shard, std::ios::in | std::ios::out | std::ios::binary);
    uint64_t n = 0;
    fs.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, '\0');
    fs.read(header.data(), std::streamsize(n));
    const auto j = nlohmann::json::parse(header);
    const int64_t begin = j["embed.weight"]["data_offsets"][0].get<int64_t>();
    const int dim = tiny_preset("flash").dim;
    std::vector<uint16_t> row(size_t(dim), 0x7F7F);  // BF16 3.39e38
    fs.seekp(std::streamoff(8 + n + begin + 7 * dim * 2));
    fs.write(reinterpret_cast<const char*>(row.data()), std::streamsize(row.size() * 2));
  }
  EngineOptions o = options(4);
  o.model_dir = d.path();
  Case bad = cases()[2], good = cases()[3];
  bad.prompt[5] = 7;
  for (int32_t& t : good.prompt)
    if (t == 7) t = 8;
  const std::vector<Result> got = run(*Engine::open(o), {bad, good});
  EXPECT_EQ(got[0].finish[0], FinishReason::kError);
  EXPECT_TRUE(got[0].tokens[0].empty());
  EXPECT_EQ(got[1].finish[0], FinishReason::kLength);
  expect_equal(got[1], run(*Engine::open(o), {good})[0], "the other request");
  // The message, through generate().
  try {
    SamplingOptions s;
    s.max_new_tokens = 2;
    Engine::open(o)->generate(bad.prompt, s);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    std::printf("error: %s\n", m.c_str());
    EXPECT_NE(m.find("non-finite"), std::string::npos) << m;
    EXPECT_NE(m.find("position 5"), std::string::npos) << m;
    EXPECT_NE(m.find("block"), std::string::npos) << m;
  }
}

TEST_F(EngineLoopTest, BadRequestsAreErrors) {
  std::unique_ptr<Engine> e = Engine::open(options(2));
  SamplingOptions s;
  EXPECT_THROW(e->add_request({}, s, 1), Error);
  EXPECT_THROW(e->add_request({2048}, s, 1), Error);
  EXPECT_THROW(e->add_request(std::vector<int32_t>(97, 3), s, 1), Error);
  s.max_new_tokens = 90;
  EXPECT_THROW(e->add_request(std::vector<int32_t>(10, 3), s, 1), Error);
  s = SamplingOptions{};
  EXPECT_THROW(e->add_request({3}, s, 0), Error);
  EXPECT_THROW(e->add_request({3}, s, 3), Error);  // more choices than sequences
  s.top_p = 0;
  EXPECT_THROW(e->add_request({3}, s, 1), Error);
  s = SamplingOptions{};
  s.temperature = -1;
  EXPECT_THROW(e->add_request({3}, s, 1), Error);
  s = SamplingOptions{};
  s.logit_bias = {{-1, 1.0f}};
  EXPECT_THROW(e->add_request({3}, s, 1), Error);
  s = SamplingOptions{};
  s.top_logprobs = 21;
  EXPECT_THROW(e->add_request({3}, s, 1), Error);
  EXPECT_FALSE(e->has_work());
}

}  // namespace
}  // namespace dsv4::test
