#include "model/cache_spec.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4 {

CacheSpec cache_spec(const ModelConfig& c) {
  CacheSpec s;
  s.window = c.window_size;
  for (int r : c.compress_ratios) {
    s.has_c4 |= (r == 4);
    s.has_c128 |= (r == 128);
  }
  return s;
}

KvEntryLayout kv_layout(const ModelConfig& c) {
  KvEntryLayout l;
  l.nope_dim = c.nope_head_dim();
  l.rope_dim = c.rope_head_dim;
  return l;
}

IndexKeyLayout index_layout(const ModelConfig& c) {
  IndexKeyLayout l;
  l.dim = c.index_head_dim > 0 ? c.index_head_dim : 128;
  return l;
}

CompressorStateLayout main_state_layout(const ModelConfig& c, int block) {
  return {c.ratio(block), c.head_dim};
}

CompressorStateLayout index_state_layout(const ModelConfig& c) {
  return {4, index_layout(c).dim};
}

PageKind compressed_kind(const ModelConfig& c, int block) {
  return c.ratio(block) == 4 ? PageKind::kC4 : PageKind::kC128;
}

CacheStoreBytes cache_store_bytes(const ModelConfig& m, const CacheConfig& c, int block) {
  const int64_t kvp = kv_layout(m).page_bytes(c.page_size);
  const int64_t ixp = index_layout(m).page_bytes(c.page_size);
  CacheStoreBytes s;
  s.window = int64_t(c.pages[int(PageKind::kWindow)]) * kvp;
  const int r = m.ratio(block);
  if (r > 0) {
    s.compressed = int64_t(c.pages[int(compressed_kind(m, block))]) * kvp;
    s.main_state = int64_t(c.max_seqs) * main_state_layout(m, block).bytes();
  }
  if (r == 4) {
    s.index_keys = int64_t(c.pages[int(PageKind::kC4)]) * ixp;
    s.index_state = int64_t(c.max_seqs) * index_state_layout(m).bytes();
  }
  return s;
}

int64_t cache_alloc_bytes(int64_t bytes, bool exists) {
  if (!exists) return 0;
  return (std::max<int64_t>(bytes, 1) + kCacheStoreAlign - 1) / kCacheStoreAlign * kCacheStoreAlign;
}

int64_t cache_bytes(const ModelConfig& m, const CacheConfig& c) {
  int64_t total = 0;
  for (int b = 0; b < m.num_blocks(); ++b) {
    const CacheStoreBytes s = cache_store_bytes(m, c, b);
    const int r = m.ratio(b);
    total += cache_alloc_bytes(s.window, true) + cache_alloc_bytes(s.compressed, r > 0) +
             cache_alloc_bytes(s.index_keys, r == 4) + cache_alloc_bytes(s.main_state, r > 0) +
             cache_alloc_bytes(s.index_state, r == 4);
  }
  return total;
}

CacheConfig cache_fixed_part(const ModelConfig& c, int max_seqs, int page_size, int extra_slots) {
  CacheConfig fixed = plan_cache(c, max_seqs, 0, page_size, 0, extra_slots);
  fixed.pages[int(PageKind::kC4)] = fixed.pages[int(PageKind::kC128)] = 0;
  return fixed;
}

CacheConfig plan_cache(const ModelConfig& c, int max_seqs, int64_t max_context, int page_size,
                       int64_t budget, int extra_slots) {
  DSV4_CHECK(extra_slots >= 0, "negative extra cache slots");
  CacheConfig want = cache_capacity(c, max_seqs, max_context, page_size);
  if (extra_slots > 0) {
    const CacheConfig extra = cache_capacity(c, extra_slots, 0, page_size);
    want.max_seqs += extra_slots;
    want.pages[int(PageKind::kWindow)] += extra.pages[int(PageKind::kWindow)];
  }
  if (budget <= 0) return want;
  // The snapshot slots' rings and states are part of the fixed bytes too.
  CacheConfig fixed = want;
  fixed.pages[int(PageKind::kC4)] = fixed.pages[int(PageKind::kC128)] = 0;
  const int64_t base = cache_bytes(c, fixed);
  DSV4_CHECK(base <= budget, "cache budget of ", budget, " bytes is below the ", base, " bytes (",
             (base + (1 << 20) - 1) >> 20, " MiB) that the window rings and compressor ",
             "states of ", want.max_seqs, " sequence(s) need");
  // Bytes per page of each kind over all blocks, and the tokens one page covers.
  CacheConfig one = fixed;
  one.pages[int(PageKind::kC4)] = 1;
  const int64_t c4_page = cache_bytes(c, one) - base;
  one = fixed;
  one.pages[int(PageKind::kC128)] = 1;
  const int64_t c128_page = cache_bytes(c, one) - base;
  const double per_token = (c4_page ? double(c4_page) / (4.0 * page_size) : 0.0) +
                           (c128_page ? double(c128_page) / (128.0 * page_size) : 0.0);
  // Allocation granularity (256 B per store) makes cache_bytes slightly super-additive: aim a
  // little below the budget and check.
  int64_t tokens = per_token > 0 ? int64_t(double(budget - base) * 0.99 / per_token) : 0;
  CacheConfig out = fixed;
  for (;;) {
    out.pages[int(PageKind::kC4)] = c4_page ? int(tokens / 4 / page_size) : 0;
    out.pages[int(PageKind::kC128)] = c128_page ? int(tokens / 128 / page_size) : 0;
    if (cache_bytes(c, out) <= budget || tokens == 0) break;
    tokens = tokens * 95 / 100;
  }
  return out;
}

}  // namespace dsv4
