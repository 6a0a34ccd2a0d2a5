// The CUDA forward pass's op boundaries (model/op_event.h): an observer registered on the model
// sees every op of a step exactly once, before and after it, with its block and tensors — the
// counts follow from the layer kinds (SWA, HCA with its compressor, CSA with both compressors
// and the indexer) — and observing changes no result: the logits of a prefill and of a decode
// step are bit-identical with and without the observer.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "cuda/engine_test_support.h"
#include "model/op_event.h"
#include "model/tiny_checkpoint.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

struct Counter : OpObserver {
  std::map<OpKind, int> before_n, after_n;
  int staged_kv = 0, bad = 0;
  void before(const OpEvent& e) override { ++before_n[e.kind]; }
  void after(const OpEvent& e) override {
    ++after_n[e.kind];
    if (e.kind == OpKind::kKvEntries && e.t[1].data) ++staged_kv;
    if (e.kind != OpKind::kStepBegin && e.kind != OpKind::kStepEnd &&
        (!e.t[0].data || e.t[0].rows <= 0))
      ++bad;
  }
};

std::vector<int32_t> prompt(int n, int vocab) {
  std::mt19937 rng(5);
  std::vector<int32_t> p{0};
  while (int(p.size()) < n) p.push_back(2 + int32_t(rng() % uint32_t(vocab - 2)));
  return p;
}

// The events one step of the model makes (n_layers blocks, one logits head).
std::map<OpKind, int> expected(const ModelConfig& c, bool staged) {
  std::map<OpKind, int> n;
  for (OpKind k : {OpKind::kStepBegin, OpKind::kStepEnd, OpKind::kEmbed, OpKind::kHcPre,
                   OpKind::kHcHead, OpKind::kLogits})
    n[k] = 1;
  for (int b = 0; b < c.n_layers; ++b) {
    const int r = c.ratio(b);
    for (OpKind k :
         {OpKind::kAttnSublayer, OpKind::kFfnSublayer, OpKind::kRmsNorm, OpKind::kQNormRope,
          OpKind::kKvEntries, OpKind::kAttention, OpKind::kWoA, OpKind::kSwiglu, OpKind::kMoe})
      ++n[k];
    n[OpKind::kHcPost] += 2;
    if (staged) ++n[OpKind::kWindowInsert];
    // wq_a, wkv, wq_b, wo_b, the shared expert's w1, w3, w2; the compressors' wkv and wgate;
    // the indexer's wq_b and weights_proj.
    n[OpKind::kLinear] += 7 + (r == 4 ? 4 + 2 : r > 0 ? 2 : 0);
    if (r > 0) n[OpKind::kCompressor] += r == 4 ? 2 : 1;
    if (r == 4) ++n[OpKind::kIndexer];
  }
  return n;
}

class EngineObserver : public ::testing::Test {
 protected:
  void SetUp() override {
    DSV4_SKIP_WITHOUT_GPU();
    write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kNvfp4, 11, dir_.path(),
                          tiny_init("flash"));
  }
  TempDir dir_;
};

TEST_F(EngineObserver, EveryOpOnceAndResultsUnchanged) {
  auto s = open_cuda_stack(dir_.path());
  const ModelConfig& c = s->config;
  int csa = 0, hca = 0;
  for (int b = 0; b < c.n_layers; ++b) csa += c.ratio(b) == 4, hca += c.ratio(b) == 128;
  ASSERT_GT(csa, 0);
  ASSERT_GT(hca, 0);  // every layer kind is exercised
  const std::vector<int32_t> p = prompt(40, c.vocab_size);
  CudaRunner& r = *s->runner;

  // Unobserved: prefill and one decode step.
  const int a = r.open_sequence();
  const std::vector<float> pre_a = r.step({{a, p, false}}).logits;
  const std::vector<float> dec_a = r.step({{a, {7}, false}}).logits;

  Counter n;
  s->model->add_observer(&n);
  const int b = r.open_sequence();
  const std::vector<float> pre_b = r.step({{b, p, false}}).logits;
  EXPECT_EQ(n.after_n, expected(c, true));
  for (const auto& [kind, count] : n.after_n) {
    if (kind != OpKind::kStepBegin && kind != OpKind::kStepEnd) {
      EXPECT_EQ(n.before_n[kind], count) << "op kind " << int(kind);
    }
  }
  EXPECT_EQ(n.staged_kv, c.n_layers);
  EXPECT_EQ(n.bad, 0);

  // A decode step of one sequence writes its window entries straight into the ring.
  n = Counter{};
  const std::vector<float> dec_b = r.step({{b, {7}, false}}).logits;
  EXPECT_EQ(n.after_n[OpKind::kWindowInsert], n.staged_kv);
  EXPECT_EQ(n.after_n[OpKind::kAttention], c.n_layers);
  EXPECT_EQ(n.after_n[OpKind::kLogits], 1);
  s->model->remove_observer(&n);

  ASSERT_EQ(pre_a.size(), size_t(c.vocab_size));
  EXPECT_EQ(pre_a, pre_b) << "observing changed the prefill's logits";
  EXPECT_EQ(dec_a, dec_b) << "observing changed the decode step's logits";
  // Removed: nothing more is seen.
  n = Counter{};
  r.step({{b, {9}, false}});
  EXPECT_TRUE(n.after_n.empty());
}

}  // namespace
}  // namespace dsv4::test
