#include "runtime/block_manager.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4 {

std::string page_kind_name(PageKind k) {
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

CacheConfig CacheConfig::for_capacity(const ModelConfig& m, int max_seqs, int64_t max_tokens,
                                      int page_size) {
  DSV4_CHECK(page_size > 0 && max_seqs > 0 && max_tokens >= 0, "invalid cache capacity");
  CacheConfig c;
  c.page_size = page_size;
  c.max_seqs = max_seqs;
  auto pages = [&](int64_t entries) { return (entries + page_size - 1) / page_size; };
  c.pages[int(PageKind::kWindow)] = static_cast<int>(max_seqs * pages(m.window_size));
  c.pages[int(PageKind::kC4)] = static_cast<int>(max_seqs * pages(max_tokens / 4));
  c.pages[int(PageKind::kC128)] = static_cast<int>(max_seqs * pages(max_tokens / 128));
  return c;
}

BlockManager::BlockManager(const ModelConfig& model, const CacheConfig& config)
    : config_(config), window_size_(model.window_size) {
  DSV4_CHECK(config.page_size > 0, "cache page_size must be positive");
  DSV4_CHECK(config.max_seqs > 0, "cache max_seqs must be positive");
  for (int r : model.compress_ratios) {
    has_c4_ |= (r == 4);
    has_c128_ |= (r == 128);
  }
  for (int k = 0; k < kNumPageKinds; ++k) {
    DSV4_CHECK(config.pages[k] >= 0, "negative page count");
    // Pop from the back so pages are handed out in increasing order.
    for (int p = config.pages[k] - 1; p >= 0; --p) free_[k].push_back(p);
  }
  for (int s = config.max_seqs - 1; s >= 0; --s) free_slots_.push_back(s);
}

int64_t BlockManager::entries_needed(PageKind k, int64_t tokens) const {
  switch (k) {
    case PageKind::kWindow:
      return window_size_;
    case PageKind::kC4:
      return has_c4_ ? tokens / 4 : 0;
    case PageKind::kC128:
      return has_c128_ ? tokens / 128 : 0;
  }
  return 0;
}

int64_t BlockManager::pages_needed(PageKind k, int64_t tokens) const {
  return (entries_needed(k, tokens) + config_.page_size - 1) / config_.page_size;
}

int BlockManager::take(PageKind k) {
  auto& f = free_[int(k)];
  int p = f.back();
  f.pop_back();
  return p;
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

void BlockManager::reserve(SequenceCache& s, int64_t total_tokens) {
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
    const int64_t more = pages_needed(k, total_tokens) - int64_t(s.pages[int(k)].size());
    DSV4_CHECK(more <= free_pages(k), "cache full: ", page_kind_name(k), " store needs ", more,
               " more pages for ", total_tokens, " tokens, ", free_pages(k), " free (page size ",
               config_.page_size, ")");
  }
  for (PageKind k : {PageKind::kC4, PageKind::kC128})
    while (int64_t(s.pages[int(k)].size()) < pages_needed(k, total_tokens))
      s.pages[int(k)].push_back(take(k));
}

void BlockManager::end_sequence(SequenceCache& s) {
  for (int k = 0; k < kNumPageKinds; ++k) {
    for (int p : s.pages[k]) free_[k].push_back(p);
    s.pages[k].clear();
  }
  if (s.state_slot >= 0) free_slots_.push_back(s.state_slot);
  s.state_slot = -1;
  s.tokens = s.mtp_tokens = 0;
}

}  // namespace dsv4
