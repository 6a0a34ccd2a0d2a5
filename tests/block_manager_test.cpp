// Page bookkeeping: forks share compressed pages, the first write into a shared page copies it
// (and only then), capacity queries agree with what reserve() takes, a failed reserve changes
// nothing, and pages return to the pool when their last holder ends.
#include <gtest/gtest.h>

#include <set>

#include "core/error.h"
#include "kvcache/block_manager.h"

namespace dsv4::test {
namespace {

CacheSpec spec() {
  CacheSpec s;
  s.window = 128;
  s.has_c4 = true;
  s.has_c128 = true;
  return s;
}

// Page size 8: a C4 page covers 32 tokens, a C128 page 1024.
CacheConfig config(int seqs, int c4_pages, int c128_pages) {
  CacheConfig c;
  c.page_size = 8;
  c.max_seqs = seqs;
  c.pages[int(PageKind::kWindow)] = seqs * 16;
  c.pages[int(PageKind::kC4)] = c4_pages;
  c.pages[int(PageKind::kC128)] = c128_pages;
  return c;
}

// Advances a sequence as a runner does after a step.
void grow(BlockManager& bm, SequenceCache& s, int64_t n) {
  bm.reserve(s, s.tokens + n);
  s.tokens += n;
}

TEST(BlockManager, ForkSharesCompressedPagesAndOwnsWindowAndSlot) {
  BlockManager bm(spec(), config(3, 16, 4));
  SequenceCache a = bm.begin_sequence();
  grow(bm, a, 70);  // 17 C4 entries: 3 pages, the last partly filled
  ASSERT_EQ(a.pages[int(PageKind::kC4)].size(), 3u);
  SequenceCache b = bm.fork(a);
  EXPECT_EQ(b.tokens, 70);
  EXPECT_NE(b.state_slot, a.state_slot);
  EXPECT_EQ(b.pages[int(PageKind::kC4)], a.pages[int(PageKind::kC4)]);
  for (int p : a.pages[int(PageKind::kC4)]) EXPECT_EQ(bm.refcount(PageKind::kC4, p), 2);
  std::set<int> wa(a.pages[0].begin(), a.pages[0].end()), wb(b.pages[0].begin(), b.pages[0].end());
  for (int p : wb) EXPECT_EQ(wa.count(p), 0u) << "window page " << p << " shared";
  EXPECT_EQ(bm.free_state_slots(), 1);
}

TEST(BlockManager, FirstWriteIntoASharedPageCopiesItOnce) {
  BlockManager bm(spec(), config(2, 16, 4));
  SequenceCache a = bm.begin_sequence();
  grow(bm, a, 70);
  SequenceCache b = bm.fork(a);
  const int last = a.pages[int(PageKind::kC4)][2];
  // b's next C4 entry (the 18th, at token 72) lands in the shared third page.
  EXPECT_EQ(bm.pages_to_append(b, 2, PageKind::kC4), 1);
  EXPECT_TRUE(bm.reserve(b, 71).empty());  // no entry completes: nothing written, no copy
  b.tokens = 71;
  const int free_before = bm.free_pages(PageKind::kC4);
  const std::vector<PageCopy> copies = bm.reserve(b, 72);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].kind, PageKind::kC4);
  EXPECT_EQ(copies[0].from, last);
  EXPECT_EQ(b.pages[int(PageKind::kC4)][2], copies[0].to);
  EXPECT_EQ(bm.free_pages(PageKind::kC4), free_before - 1);
  EXPECT_EQ(bm.refcount(PageKind::kC4, last), 1);
  EXPECT_EQ(bm.refcount(PageKind::kC4, copies[0].to), 1);
  b.tokens = 72;
  // The copy is private now: later writes copy nothing; a's writes neither (it holds the
  // original alone).
  EXPECT_TRUE(bm.reserve(b, 100).empty());
  EXPECT_TRUE(bm.reserve(a, 96).empty());
  // The first two pages stay shared.
  EXPECT_EQ(bm.refcount(PageKind::kC4, a.pages[int(PageKind::kC4)][0]), 2);
}

TEST(BlockManager, ForkAtAPageBoundaryCopiesNothing) {
  BlockManager bm(spec(), config(2, 16, 4));
  SequenceCache a = bm.begin_sequence();
  grow(bm, a, 64);  // 16 entries: two full pages
  SequenceCache b = bm.fork(a);
  EXPECT_EQ(bm.pages_to_append(b, 4, PageKind::kC4), 1);  // a fresh page, not a copy
  EXPECT_TRUE(bm.reserve(b, 68).empty());
  EXPECT_EQ(b.pages[int(PageKind::kC4)].size(), 3u);
}

TEST(BlockManager, CapacityQueriesAgreeWithReserve) {
  BlockManager bm(spec(), config(2, 5, 2));
  SequenceCache a = bm.begin_sequence();
  grow(bm, a, 100);
  SequenceCache b = bm.fork(a);
  for (int64_t n : {1, 3, 4, 28, 29, 60, 61, 100, 200}) {
    const int64_t want =
        bm.pages_to_append(b, n, PageKind::kC4) + bm.pages_to_append(b, n, PageKind::kC128);
    BlockManager copy = bm;
    SequenceCache bc = b;
    if (!copy.can_append(bc, n)) {
      EXPECT_THROW(copy.reserve(bc, bc.tokens + n), Error) << n;
      continue;
    }
    const int before = copy.free_pages(PageKind::kC4) + copy.free_pages(PageKind::kC128);
    copy.reserve(bc, bc.tokens + n);
    const int after = copy.free_pages(PageKind::kC4) + copy.free_pages(PageKind::kC128);
    EXPECT_EQ(before - after, want) << n;
  }
}

TEST(BlockManager, FailedReserveChangesNothing) {
  BlockManager bm(spec(), config(1, 2, 1));
  SequenceCache a = bm.begin_sequence();
  grow(bm, a, 40);
  const SequenceCache before = a;
  const int free4 = bm.free_pages(PageKind::kC4);
  EXPECT_FALSE(bm.can_append(a, 100));
  EXPECT_THROW(bm.reserve(a, 140), Error);
  EXPECT_EQ(bm.free_pages(PageKind::kC4), free4);
  EXPECT_EQ(a.pages[int(PageKind::kC4)], before.pages[int(PageKind::kC4)]);
}

TEST(BlockManager, PagesReturnWhenTheirLastHolderEnds) {
  BlockManager bm(spec(), config(3, 16, 4));
  const int total4 = bm.free_pages(PageKind::kC4), totalw = bm.free_pages(PageKind::kWindow);
  SequenceCache a = bm.begin_sequence();
  grow(bm, a, 70);
  SequenceCache b = bm.fork(a), c = bm.fork(a);
  grow(bm, c, 30);
  bm.end_sequence(a);
  EXPECT_EQ(bm.refcount(PageKind::kC4, b.pages[int(PageKind::kC4)][0]), 2);
  bm.end_sequence(b);
  bm.end_sequence(c);
  EXPECT_EQ(bm.free_pages(PageKind::kC4), total4);
  EXPECT_EQ(bm.free_pages(PageKind::kWindow), totalw);
  EXPECT_EQ(bm.free_state_slots(), 3);
  EXPECT_TRUE(bm.can_begin());
}

TEST(BlockManager, BeginNeedsASlot) {
  BlockManager bm(spec(), config(1, 4, 1));
  SequenceCache a = bm.begin_sequence();
  EXPECT_FALSE(bm.can_begin());
  EXPECT_THROW(bm.begin_sequence(), Error);
  EXPECT_THROW(bm.fork(a), Error);
}

}  // namespace
}  // namespace dsv4::test
