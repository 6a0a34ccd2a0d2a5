// What a model's sequences keep in the paged cache, in the terms the page bookkeeping needs:
// every block has a sliding-window ring of `window` slots; CSA blocks (ratio 4) have compressed
// KV and indexer keys, one entry per 4 tokens, on C4 pages; HCA blocks (ratio 128) compressed
// KV, one entry per 128 tokens, on C128 pages. model/cache_spec.h derives it from a config.
#pragma once

#include <cstdint>

namespace dsv4 {

enum class PageKind { kWindow = 0, kC4 = 1, kC128 = 2 };
constexpr int kNumPageKinds = 3;
constexpr PageKind kPageKinds[kNumPageKinds] = {PageKind::kWindow, PageKind::kC4, PageKind::kC128};

struct CacheSpec {
  int window = 0;
  bool has_c4 = false;
  bool has_c128 = false;

  // Entries a sequence of `tokens` tokens keeps in a paged store of kind `k`.
  int64_t entries(PageKind k, int64_t tokens) const {
    switch (k) {
      case PageKind::kWindow:
        return window;
      case PageKind::kC4:
        return has_c4 ? tokens / 4 : 0;
      case PageKind::kC128:
        return has_c128 ? tokens / 128 : 0;
    }
    return 0;
  }
};

// The pool: entries per page (every paged store), compressor-state slots (one per sequence
// alive at once, live or held by the prefix cache) and the page count of each kind.
struct CacheConfig {
  int page_size = 64;
  int max_seqs = 4;
  int pages[kNumPageKinds] = {0, 0, 0};

  // Enough pages for `max_seqs` sequences of up to `max_tokens` tokens each.
  static CacheConfig for_capacity(const CacheSpec& spec, int max_seqs, int64_t max_tokens,
                                  int page_size);
};

const char* page_kind_name(PageKind k);

}  // namespace dsv4
