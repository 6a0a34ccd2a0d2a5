// PagedRunner::clone_sequence (how the benchmarks fill a batch's caches from one prefilled
// sequence): the clone stands at the source's length, owns its pages (none shared with the
// source, each referenced once), and decodes bit for bit as the source does; a pool without the
// pages throws and changes nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backends/cpu/loader.h"
#include "backends/cpu/runner.h"
#include "core/error.h"
#include "model/cache_spec.h"
#include "model/tiny_checkpoint.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

std::vector<int32_t> random_prompt(const ModelConfig& c, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p{0};
  while (int(p.size()) < n) p.push_back(2 + int32_t(rng() % uint32_t(c.vocab_size - 2)));
  return p;
}

TEST(CloneSequence, OwnsItsPagesAndDecodesAsTheSource) {
  TempDir d;
  write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kNvfp4, 8, d.path(),
                        tiny_init("flash"));
  LoadedModel lm = load_cpu_model(d.path());
  const ModelConfig& c = lm.config;
  CpuRunner r(*lm.model, cache_capacity(c, 3, 200, 16));
  // 150 tokens: C4 entries over several pages, the last one partly written; one C128 entry.
  const int a = r.open_sequence();
  r.step({{a, random_prompt(c, 150, 5)}});
  const int b = r.clone_sequence(a);
  EXPECT_EQ(r.length(b), r.length(a));
  EXPECT_EQ(r.sequence(b).mtp_tokens, r.sequence(a).mtp_tokens);
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
    const std::vector<int>& pa = r.sequence(a).pages[int(k)];
    const std::vector<int>& pb = r.sequence(b).pages[int(k)];
    ASSERT_EQ(pa.size(), pb.size()) << page_kind_name(k);
    const bool has = k == PageKind::kC4 ? r.cache_spec().has_c4 : r.cache_spec().has_c128;
    EXPECT_EQ(pa.empty(), !has) << page_kind_name(k);
    const std::set<int> mine(pa.begin(), pa.end());
    for (int p : pb) {
      EXPECT_EQ(mine.count(p), 0u) << page_kind_name(k) << " page " << p << " shared";
      EXPECT_EQ(r.blocks().refcount(k, p), 1) << page_kind_name(k) << " page " << p;
    }
  }
  // The same tokens on both: the same logits, step after step (each reads its own copies).
  std::mt19937 rng(9);
  for (int i = 0; i < 4; ++i) {
    const int32_t t = 2 + int32_t(rng() % uint32_t(c.vocab_size - 2));
    const std::vector<float> la = r.step({{a, {t}}}).logits;
    const std::vector<float> lb = r.step({{b, {t}}}).logits;
    ASSERT_EQ(la.size(), size_t(c.vocab_size));
    ASSERT_EQ(lb.size(), la.size());
    EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * 4), 0) << "step " << i;
  }
  // A fresh sequence fed the same token differs: the comparison above can fail.
  const int e = r.open_sequence();
  const std::vector<float> le = r.step({{e, {7}}}).logits;
  const std::vector<float> la = r.step({{a, {7}}}).logits;
  EXPECT_NE(std::memcmp(le.data(), la.data(), la.size() * 4), 0);
}

TEST(CloneSequence, WithoutRoomThrowsAndChangesNothing) {
  TempDir d;
  write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kNvfp4, 8, d.path(),
                        tiny_init("flash"));
  LoadedModel lm = load_cpu_model(d.path());
  const ModelConfig& c = lm.config;
  // Compressed pages for two sequences of 160 tokens, state slots and windows for three.
  CacheConfig cc = cache_capacity(c, 2, 160, 16);
  const CacheConfig three = cache_capacity(c, 3, 160, 16);
  cc.max_seqs = three.max_seqs;
  cc.pages[int(PageKind::kWindow)] = three.pages[int(PageKind::kWindow)];
  CpuRunner r(*lm.model, cc);
  const int a = r.open_sequence();
  r.step({{a, random_prompt(c, 150, 6)}});
  r.clone_sequence(a);  // the second sequence's share
  const BlockManager& bm = r.blocks();
  int free_before[kNumPageKinds];
  for (PageKind k : kPageKinds) free_before[int(k)] = bm.free_pages(k);
  const int slots_before = bm.free_state_slots();
  ASSERT_GT(slots_before, 0);
  try {
    r.clone_sequence(a);
    ADD_FAILURE() << "a third clone fitted";
  } catch (const Error& e) {  // the pages, not the slot or the window (those have room)
    EXPECT_NE(std::string(e.what()).find("cache full"), std::string::npos) << e.what();
  }
  for (PageKind k : kPageKinds) EXPECT_EQ(bm.free_pages(k), free_before[int(k)]);
  EXPECT_EQ(bm.free_state_slots(), slots_before);
}

}  // namespace
}  // namespace dsv4::test
