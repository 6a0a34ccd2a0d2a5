// The parallel engine on the CPU backend (ranks as threads): for every (dp, ep, tp) tuple the
// issue names, prompt logits and served tokens (logprobs included) are bit-identical to one
// rank, on both make-tiny presets and the golden checkpoints, including steps in which some
// data-parallel ranks have no work; layouts that do not divide are clear errors.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "comm/inproc_communicator.h"
#include "core/error.h"
#include "dsv4/engine.h"
#include "model/model_config.h"
#include "model/parallel_layout.h"
#include "model/tiny_checkpoint.h"
#include "support/golden.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

struct Tuple {
  int dp, ep, tp;
};
const Tuple kTuples[] = {{1, 2, 1}, {2, 2, 1}, {1, 4, 1}, {1, 1, 2}, {2, 2, 2}};

std::string name(const Tuple& t) {
  return "dp" + std::to_string(t.dp) + " ep" + std::to_string(t.ep) + " tp" + std::to_string(t.tp);
}

EngineOptions options(const std::string& dir, const Tuple& t, int seqs = 4) {
  EngineOptions o;
  o.model_dir = dir;
  o.page_size = 16;
  o.max_sequences = seqs;
  o.max_tokens = 80;
  o.dp = t.dp;
  o.ep = t.ep;
  o.tp = t.tp;
  o.prefix_block = 16;
  return o;
}

struct Served {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<TokenLogprob>> logprobs;
};

// Requests of mixed lengths and sampling, all queued at once.
Served serve(Engine& e, int vocab) {
  std::mt19937 rng(23);
  Served s;
  std::map<uint64_t, size_t> index;
  const int lens[] = {37, 5, 20, 1, 50, 12};
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> p{0};
    while (int(p.size()) < lens[i]) p.push_back(2 + int32_t(rng() % uint32_t(vocab - 2)));
    SamplingOptions o;
    o.max_new_tokens = 5;
    o.stop_at_eos = false;
    o.seed = 7 + uint64_t(i);
    o.temperature = i % 2 ? 0.9f : 0.0f;
    o.logprobs = true;
    o.top_logprobs = 2;
    index[e.add_request(p, o, 1)] = size_t(i);
  }
  s.tokens.resize(6);
  s.logprobs.resize(6);
  while (e.has_work())
    for (const RequestOutput& o : e.step()) {
      EXPECT_NE(o.finish, FinishReason::kError) << o.error;
      const size_t i = index.at(o.request);
      s.tokens[i].insert(s.tokens[i].end(), o.tokens.begin(), o.tokens.end());
      s.logprobs[i].insert(s.logprobs[i].end(), o.logprobs.begin(), o.logprobs.end());
    }
  return s;
}

void expect_same(const Served& got, const Served& want, const std::string& what) {
  for (size_t i = 0; i < want.tokens.size(); ++i) {
    EXPECT_EQ(got.tokens[i], want.tokens[i]) << what << " request " << i;
    ASSERT_EQ(got.logprobs[i].size(), want.logprobs[i].size()) << what;
    for (size_t k = 0; k < want.logprobs[i].size(); ++k) {
      EXPECT_EQ(got.logprobs[i][k].logprob, want.logprobs[i][k].logprob) << what;
      EXPECT_EQ(got.logprobs[i][k].top, want.logprobs[i][k].top) << what;
    }
  }
}

// Every tuple against one rank on one model directory.
void check_model(const std::string& dir) {
  const ModelConfig c = load_model_config(dir + "/config.json");
  std::mt19937 rng(3);
  std::vector<int32_t> prompt{0};
  while (prompt.size() < 70) prompt.push_back(2 + int32_t(rng() % uint32_t(c.vocab_size - 2)));
  const Tuple one{1, 1, 1};
  std::unique_ptr<Engine> ref = Engine::open(options(dir, one));
  const std::vector<float> want = ref->prompt_logits(prompt, 0);
  const std::vector<float> want_chunked = ref->prompt_logits(prompt, 17);
  const Served want_served = serve(*ref, c.vocab_size);
  for (const Tuple& t : kTuples) {
    std::unique_ptr<Engine> e = Engine::open(options(dir, t));
    // One request: with dp > 1 the other data-parallel ranks have no work.
    const std::vector<float> got = e->prompt_logits(prompt, 0);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << name(t);
    const std::vector<float> chunked = e->prompt_logits(prompt, 17);
    EXPECT_EQ(std::memcmp(chunked.data(), want_chunked.data(), chunked.size() * 4), 0) << name(t);
    expect_same(serve(*e, c.vocab_size), want_served, name(t));
    EXPECT_EQ(e->stats().cache_usage, 0.0) << name(t);
  }
}

TEST(Parallel, EveryTupleEqualsOneRankOnMakeTinyPresets) {
  for (const char* preset : {"flash", "pro"}) {
    TempDir d;
    write_tiny_checkpoint(tiny_preset(preset), ExpertFormat::kNvfp4, 8, d.path(),
                          tiny_init(preset));
    SCOPED_TRACE(preset);
    check_model(d.path());
  }
}

TEST(Parallel, EveryTupleEqualsOneRankOnTheGoldenCheckpoints) {
  const std::string root = golden_root();
  if (root.empty()) GTEST_SKIP() << "golden data not found";
  for (const char* set : {"tiny-flash", "tiny-pro"}) {
    SCOPED_TRACE(set);
    check_model(root + "/" + set + "/hf-mxfp4");
  }
}

TEST(Parallel, LayoutsThatDoNotDivideAreErrors) {
  const ModelConfig c = tiny_preset("flash");  // 4 heads, 2 groups, 8 index heads, 16 experts
  auto layout = [&](int dp, int ep, int tp) { return ParallelLayout(c, {dp, ep, tp}); };
  EXPECT_NO_THROW(layout(2, 4, 2));
  EXPECT_THROW(layout(3, 2, 1), Error);  // 2 does not divide 3
  EXPECT_THROW(layout(1, 3, 1), Error);  // 3 experts ranks for 16
  EXPECT_THROW(layout(1, 1, 4), Error);  // 4 ranks for 2 output groups
  EXPECT_THROW(layout(0, 1, 1), Error);
  const ParallelLayout L = layout(2, 2, 2);
  EXPECT_EQ(L.world(), 4);
  EXPECT_EQ(L.dp_group(0), 0);
  EXPECT_EQ(L.dp_group(2), 1);
  EXPECT_EQ(L.tp_rank(3), 1);
  EXPECT_EQ(L.expert_owner(1, 9), 3);
}

TEST(Parallel, InProcessCollectives) {
  const int n = 3;
  auto comms = make_inproc_communicators(n);
  std::vector<std::thread> threads;
  std::vector<std::vector<int>> gathered(n);
  std::vector<std::vector<std::vector<uint8_t>>> received(n);
  std::vector<int> sub_rank(n), sub_size(n);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      Communicator& c = *comms[size_t(r)];
      gathered[size_t(r)] = c.all_gather(std::vector<int>{r, 10 * r});
      std::vector<std::vector<uint8_t>> send(n);
      for (int d = 0; d < n; ++d) send[size_t(d)].assign(size_t(r + d), uint8_t(r));
      c.all_to_all(send, received[size_t(r)]);
      auto sub = c.split(r % 2, -r);  // {0, 2} ordered by key: 2 first
      sub_rank[size_t(r)] = sub->rank();
      sub_size[size_t(r)] = sub->size();
      sub->barrier();
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(gathered[size_t(r)], (std::vector<int>{0, 0, 1, 10, 2, 20}));
    for (int s = 0; s < n; ++s)
      EXPECT_EQ(received[size_t(r)][size_t(s)], std::vector<uint8_t>(size_t(s + r), uint8_t(s)));
  }
  EXPECT_EQ(sub_size, (std::vector<int>{2, 1, 2}));
  EXPECT_EQ(sub_rank, (std::vector<int>{1, 0, 0}));
}

TEST(Parallel, AnAbortedCollectiveThrowsInsteadOfHanging) {
  auto comms = make_inproc_communicators(2);
  std::thread waiter([&] { EXPECT_THROW(comms[0]->barrier(), Error); });
  comms[1]->abort();
  waiter.join();
}

}  // namespace
}  // namespace dsv4::test
