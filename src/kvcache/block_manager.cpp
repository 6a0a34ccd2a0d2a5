#include "kvcache/block_manager.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4 {

const char* page_kind_name(PageKind k) {
  switch (k) {
    case PageKind::kWindow:
      return "sliding-window KV";
    case PageKind::kC4:
      return "C4 compressed KV / indexer keys";
    case PageKind::kC128:
      return "C128 compressed KV";
  }
  return "?";
}

CacheConfig CacheConfig::for_capacity(const CacheSpec& spec, int max_seqs, int64_t max_tokens,
                                      int page_size) {
  DSV4_CHECK(page_size > 0 && max_seqs > 0 && max_tokens >= 0, "invalid cache capacity");
  CacheConfig c;
  c.page_size = page_size;
  c.max_seqs = max_seqs;
  for (PageKind k : kPageKinds) {
    const int64_t per_seq = (spec.entries(k, max_tokens) + page_size - 1) / page_size;
    const int64_t total = max_seqs * per_seq;
    DSV4_CHECK(total <= (int64_t(1) << 30), "cache of ", max_seqs, " sequences of ", max_tokens,
               " tokens needs ", total, " ", page_kind_name(k), " pages (too many)");
    c.pages[int(k)] = static_cast<int>(total);
  }
  return c;
}

BlockManager::BlockManager(const CacheSpec& spec, const CacheConfig& config)
    : spec_(spec), config_(config) {
  DSV4_CHECK(config.page_size > 0, "cache page_size must be positive");
  DSV4_CHECK(config.max_seqs > 0, "cache max_seqs must be positive");
  for (int k = 0; k < kNumPageKinds; ++k) {
    DSV4_CHECK(config.pages[k] >= 0, "negative page count");
    // Pop from the back so pages are handed out in increasing order.
    for (int p = config.pages[k] - 1; p >= 0; --p) free_[k].push_back(p);
    refs_[k].assign(size_t(config.pages[k]), 0);
  }
  for (int s = config.max_seqs - 1; s >= 0; --s) free_slots_.push_back(s);
}

int64_t BlockManager::pages_needed(PageKind k, int64_t tokens) const {
  return (entries_needed(k, tokens) + config_.page_size - 1) / config_.page_size;
}

std::pair<int64_t, int64_t> BlockManager::written_pages(const SequenceCache& s, PageKind k,
                                                        int64_t total_tokens) const {
  const int64_t have = entries_needed(k, s.tokens), want = entries_needed(k, total_tokens);
  if (want <= have) return {0, 0};
  return {have / config_.page_size, (want - 1) / config_.page_size + 1};
}

int64_t BlockManager::pages_to_append(const SequenceCache& s, int64_t n, PageKind k) const {
  if (k == PageKind::kWindow) return 0;
  const int64_t total = s.tokens + n;
  const std::vector<int>& table = s.pages[int(k)];
  int64_t more = std::max<int64_t>(0, pages_needed(k, total) - int64_t(table.size()));
  const auto [lo, hi] = written_pages(s, k, total);
  for (int64_t i = lo; i < std::min<int64_t>(hi, int64_t(table.size())); ++i)
    if (refs_[int(k)][size_t(table[size_t(i)])] > 1) ++more;  // a shared page it writes into
  return more;
}

bool BlockManager::can_begin() const {
  return !free_slots_.empty() &&
         free_pages(PageKind::kWindow) >= pages_needed(PageKind::kWindow, 0);
}

bool BlockManager::can_append(const SequenceCache& s, int64_t n) const {
  for (PageKind k : {PageKind::kC4, PageKind::kC128})
    if (pages_to_append(s, n, k) > free_pages(k)) return false;
  return true;
}

int BlockManager::take(PageKind k) {
  auto& f = free_[int(k)];
  const int p = f.back();
  f.pop_back();
  refs_[int(k)][size_t(p)] = 1;
  return p;
}

void BlockManager::release(PageKind k, int page) {
  int& r = refs_[int(k)].at(size_t(page));
  DSV4_CHECK(r > 0, "page ", page, " of the ", page_kind_name(k), " store released twice");
  if (--r == 0) free_[int(k)].push_back(page);
}

SequenceCache BlockManager::begin_sequence() {
  DSV4_CHECK(!free_slots_.empty(), "cache full: all ", config_.max_seqs,
             " sequence slots are in use");
  const int64_t need = pages_needed(PageKind::kWindow, 0);
  DSV4_CHECK(free_pages(PageKind::kWindow) >= need,
             "cache full: ", page_kind_name(PageKind::kWindow), " store needs ", need, " pages, ",
             free_pages(PageKind::kWindow), " free");
  SequenceCache s;
  s.state_slot = free_slots_.back();
  free_slots_.pop_back();
  for (int64_t i = 0; i < need; ++i)
    s.pages[int(PageKind::kWindow)].push_back(take(PageKind::kWindow));
  return s;
}

SequenceCache BlockManager::fork(const SequenceCache& src) {
  SequenceCache s = begin_sequence();
  s.tokens = src.tokens;
  s.mtp_tokens = src.mtp_tokens;
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
    s.pages[int(k)] = src.pages[int(k)];
    for (int p : s.pages[int(k)]) ++refs_[int(k)].at(size_t(p));
  }
  return s;
}

std::vector<PageCopy> BlockManager::reserve(SequenceCache& s, int64_t total_tokens) {
  DSV4_CHECK(total_tokens >= s.tokens, "reserve below the sequence's length");
  const int64_t n = total_tokens - s.tokens;
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
    const int64_t more = pages_to_append(s, n, k);
    DSV4_CHECK(more <= free_pages(k), "cache full: ", page_kind_name(k), " store needs ", more,
               " more pages for ", total_tokens, " tokens, ", free_pages(k), " free (page size ",
               config_.page_size, ")");
  }
  std::vector<PageCopy> copies;
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
    std::vector<int>& table = s.pages[int(k)];
    const auto [lo, hi] = written_pages(s, k, total_tokens);
    for (int64_t i = lo; i < std::min<int64_t>(hi, int64_t(table.size())); ++i) {
      const int from = table[size_t(i)];
      if (refs_[int(k)][size_t(from)] == 1) continue;
      const int to = take(k);
      release(k, from);
      table[size_t(i)] = to;
      copies.push_back({k, from, to});
    }
    while (int64_t(table.size()) < pages_needed(k, total_tokens)) table.push_back(take(k));
  }
  return copies;
}

void BlockManager::truncate(SequenceCache& s, int64_t tokens) {
  DSV4_CHECK(tokens >= 0, "truncate to a negative length");
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
    std::vector<int>& table = s.pages[int(k)];
    const size_t keep = size_t(pages_needed(k, tokens));
    while (table.size() > keep) {
      release(k, table.back());
      table.pop_back();
    }
  }
  s.tokens = tokens;
}

void BlockManager::end_sequence(SequenceCache& s) {
  for (PageKind k : kPageKinds) {
    for (int p : s.pages[int(k)]) release(k, p);
    s.pages[int(k)].clear();
  }
  if (s.state_slot >= 0) free_slots_.push_back(s.state_slot);
  s.state_slot = -1;
  s.tokens = s.mtp_tokens = 0;
}

}  // namespace dsv4
