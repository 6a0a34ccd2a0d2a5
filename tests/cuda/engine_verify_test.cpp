// CUDA backend vs CPU backend op by op, on make-tiny checkpoints of both presets (what
// `dsv4 ... --backend cuda --verify` does): every op of the CUDA forward re-run by the CPU op on
// the CUDA op's own inputs and held to the kernel issues' tolerances; cache stores (window and
// compressed KV, indexer keys) >= 99.9 % byte-identical at write time with the rest one e4m3 /
// e2m1 step apart, after a 300-token prefill and after 300 decode steps; a mixed batch of
// prefill chunks and decode tokens; and the verifier catching injected faults (a corrupted
// weight, a corrupted compressor parameter) at the op they hit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>

#include "core/error.h"
#include "cuda/engine_test_support.h"
#include "model/tiny_checkpoint.h"
#include "ops/cpu/sampler.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

struct Case {
  const char* preset;
  ExpertFormat format;
  bool exact_linears = false;  // FP8 linears on the exact W8A16 path
};

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return std::string(i.param.preset) +
         (i.param.format == ExpertFormat::kNvfp4 ? "_nvfp4" : "_mxfp4") +
         (i.param.exact_linears ? "_exact_linears" : "");
}

class EngineVerify : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    DSV4_SKIP_WITHOUT_GPU();
    write_tiny_checkpoint(tiny_preset(GetParam().preset), GetParam().format, 11, dir_.path(),
                          tiny_init(GetParam().preset));
  }
  std::vector<int32_t> prompt(int n, int vocab, uint32_t seed) const {
    std::mt19937 rng(seed);
    std::vector<int32_t> p{0};
    while (int(p.size()) < n) p.push_back(2 + int32_t(rng() % uint32_t(vocab - 2)));
    return p;
  }
  void print_stores(const CudaVerifier& v, const char* when) {
    for (int k = 0; k < 3; ++k) {
      const CacheStoreStats& s = v.store_stats(k);
      std::printf(
          "  [%s] %s store %d: %lld bytes written, %.4f%% identical, %lld/%lld elements "
          "one step apart\n",
          GetParam().preset, when, k, (long long)s.bytes, 100 * s.identical_fraction(),
          (long long)s.elements_one_step, (long long)s.elements);
    }
  }
  void expect_stores(const CudaVerifier& v, const char* when) {
    print_stores(v, when);
    for (int k = 0; k < 3; ++k) {
      const CacheStoreStats& s = v.store_stats(k);
      EXPECT_GT(s.bytes, 0) << when << " store " << k;
      EXPECT_GE(s.identical_fraction(), 0.999) << when << " store " << k;
      EXPECT_EQ(s.elements_beyond, 0) << when << " store " << k;
    }
  }
  TempDir dir_;
};

TEST_P(EngineVerify, Prefill300ThenDecode300) {
  CudaStackOptions o;
  o.exact_linears = GetParam().exact_linears;
  o.verify = true;
  o.max_seqs = 1;
  o.max_context = 640;
  o.max_step_tokens = 320;
  auto s = open_cuda_stack(dir_.path(), o);
  const int V = s->V();
  const std::vector<int32_t> p = prompt(300, V, 5);
  CudaRunner& r = *s->runner;
  const int seq = r.open_sequence();
  std::vector<float> logits;
  try {
    logits = r.step_logits({{seq, p, false}});
  } catch (const VerifyError& e) {
    FAIL() << "prefill: " << e.what();
  }
  std::printf("%s\n", s->verifier->summary().c_str());
  expect_stores(*s->verifier, "after prefill 300");
  const int64_t prefill_checks = s->verifier->ops_checked();
  try {
    for (int i = 0; i < 300; ++i) {
      const int32_t next = cpu::argmax(logits.data(), V);
      logits = r.step_logits({{seq, {next}, false}});
    }
  } catch (const VerifyError& e) {
    FAIL() << "decode: " << e.what();
  }
  std::printf("%s\n", s->verifier->summary().c_str());
  expect_stores(*s->verifier, "after 300 decode steps");
  EXPECT_GT(s->verifier->ops_checked(), prefill_checks);
  r.close_sequence(seq);
}

// Three sequences in one step, mixing prefill chunks (crossing 4- and 128-boundaries, longer
// than the window) and decode tokens; then a decode-only step of all three.
TEST_P(EngineVerify, MixedBatch) {
  CudaStackOptions o;
  o.exact_linears = GetParam().exact_linears;
  o.verify = true;
  o.max_seqs = 3;
  o.max_context = 400;
  o.max_step_tokens = 320;
  auto s = open_cuda_stack(dir_.path(), o);
  const int V = s->V();
  CudaRunner& r = *s->runner;
  const int a = r.open_sequence(), b = r.open_sequence(), c = r.open_sequence();
  const std::vector<int32_t> pa = prompt(200, V, 1), pb = prompt(200, V, 2), pc = prompt(200, V, 3);
  try {
    r.step_logits(
        {{a, {pa.begin(), pa.begin() + 37}, true}, {b, {pb.begin(), pb.begin() + 130}, false}});
    r.step_logits({{a, {pa[37]}, false},
                   {b, {pb.begin() + 130, pb.begin() + 135}, true},
                   {c, {pc.begin(), pc.begin() + 141}, false}});
    for (int i = 0; i < 3; ++i)
      r.step_logits(
          {{a, {pa[38 + i]}, false}, {b, {pb[135 + i]}, false}, {c, {pc[141 + i]}, false}});
    r.step_logits({{c, {pc.begin() + 144, pc.begin() + 150}, true}, {a, {pa[41]}, false}});
  } catch (const VerifyError& e) {
    FAIL() << e.what();
  }
  std::printf("%s\n", s->verifier->summary().c_str());
  print_stores(*s->verifier, "mixed batch");
  EXPECT_EQ(r.length(a), 42);
  EXPECT_EQ(r.length(b), 138);
  EXPECT_EQ(r.length(c), 150);
}

// The verifier must name the op a fault hits: a corrupted FP8 weight of one block's wq_b,
// then a corrupted compressor ape.
TEST_P(EngineVerify, CatchesInjectedFaults) {
  CudaStackOptions o;
  o.exact_linears = GetParam().exact_linears;
  o.verify = true;
  o.max_seqs = 1;
  const ModelConfig c = tiny_preset(GetParam().preset);
  int csa = 0;
  while (c.ratio(csa) != 4) ++csa;
  const std::vector<int32_t> p = prompt(40, c.vocab_size, 9);
  {
    auto s = open_cuda_stack(dir_.path(), o);
    const CudaBlockWeights& b = s->model->weights().blocks[csa];
    DSV4_CUDA_CHECK(cudaMemset(const_cast<uint8_t*>(b.wq_b.codes.data()) + 1000, 0x7e, 64));
    const int seq = s->runner->open_sequence();
    try {
      s->runner->step({{seq, p, false}});
      ADD_FAILURE() << "a corrupted wq_b went unnoticed";
    } catch (const VerifyError& e) {
      std::printf("  caught: %s\n", e.what());
      const std::string m = e.what();
      EXPECT_NE(m.find("block " + std::to_string(csa)), std::string::npos) << m;
      EXPECT_NE(m.find("attn.wq_b"), std::string::npos) << m;
    }
  }
  {
    auto s = open_cuda_stack(dir_.path(), o);
    const CudaBlockWeights& b = s->model->weights().blocks[csa];
    DSV4_CUDA_CHECK(cudaMemset(const_cast<float*>(b.main_ape.data()) + 3, 0x40, 16));
    const int seq = s->runner->open_sequence();
    try {
      s->runner->step({{seq, p, false}});
      ADD_FAILURE() << "a corrupted compressor ape went unnoticed";
    } catch (const VerifyError& e) {
      std::printf("  caught: %s\n", e.what());
      const std::string m = e.what();
      EXPECT_NE(m.find("block " + std::to_string(csa)), std::string::npos) << m;
      EXPECT_NE(m.find("compressor"), std::string::npos) << m;
    }
  }
}

// --verify-layers: a fault in a block outside the checked range goes unjudged (those ops run
// unchecked; later blocks are judged from the GPU's own inputs, so they still pass), the same
// fault inside it is caught; a range outside the model's blocks is refused.
TEST_P(EngineVerify, ChecksOnlyTheChosenBlocks) {
  CudaStackOptions o;
  o.exact_linears = GetParam().exact_linears;
  o.verify = true;
  o.max_seqs = 1;
  const ModelConfig c = tiny_preset(GetParam().preset);
  int csa = 0;
  while (c.ratio(csa) != 4) ++csa;
  const std::vector<int32_t> p = prompt(40, c.vocab_size, 9);
  int64_t all_checks = 0;
  {
    auto s = open_cuda_stack(dir_.path(), o);
    const int seq = s->runner->open_sequence();
    s->runner->step({{seq, p, false}});
    all_checks = s->verifier->ops_checked();
  }
  for (const bool inside : {false, true}) {
    auto s = open_cuda_stack(dir_.path(), o);
    EXPECT_THROW(s->verifier->set_blocks(0, c.num_blocks()), Error);
    EXPECT_THROW(s->verifier->set_blocks(2, 1), Error);
    if (inside)
      s->verifier->set_blocks(csa, csa);
    else if (csa + 1 < c.num_blocks())
      s->verifier->set_blocks(csa + 1, -1);
    else
      s->verifier->set_blocks(0, csa - 1);
    const CudaBlockWeights& b = s->model->weights().blocks[csa];
    DSV4_CUDA_CHECK(cudaMemset(const_cast<uint8_t*>(b.wq_b.codes.data()) + 1000, 0x7e, 64));
    const int seq = s->runner->open_sequence();
    try {
      s->runner->step({{seq, p, false}});
      EXPECT_FALSE(inside) << "a corrupted wq_b in the checked block went unnoticed";
      const std::string sum = s->verifier->summary();
      EXPECT_NE(sum.find("the other blocks ran unchecked"), std::string::npos) << sum;
      EXPECT_GT(s->verifier->ops_checked(), 0);
      EXPECT_LT(s->verifier->ops_checked(), all_checks);
    } catch (const VerifyError& e) {
      EXPECT_TRUE(inside) << "a block outside the range was judged: " << e.what();
      const std::string m = e.what();
      EXPECT_NE(m.find("attn.wq_b"), std::string::npos) << m;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, EngineVerify,
                         ::testing::Values(Case{"flash", ExpertFormat::kNvfp4},
                                           Case{"pro", ExpertFormat::kMxfp4},
                                           Case{"flash", ExpertFormat::kMxfp4, true},
                                           Case{"pro", ExpertFormat::kNvfp4, true}),
                         case_name);

}  // namespace
}  // namespace dsv4::test
