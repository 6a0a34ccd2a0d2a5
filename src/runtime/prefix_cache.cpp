#include "runtime/prefix_cache.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4 {

PrefixCache::PrefixCache(Runner& runner, int block, int max_snapshots, int dp_rank)
    : runner_(runner), dp_rank_(dp_rank), block_(block), max_(max_snapshots) {
  DSV4_CHECK(block > 0 && max_snapshots >= 0, "prefix cache: block must be positive");
}

PrefixCache::~PrefixCache() {
  clear();
}

void PrefixCache::clear() {
  while (evict_one()) {
  }
}

std::vector<uint64_t> PrefixCache::chain(const std::vector<int32_t>& tokens, int64_t n) const {
  std::vector<uint64_t> h;
  uint64_t x = 0x6A09E667F3BCC908ull;
  for (int64_t k = 0; (k + 1) * block_ <= n; ++k) {
    for (int64_t i = k * block_; i < (k + 1) * block_; ++i)
      x = splitmix64(x ^ (uint64_t(uint32_t(tokens[size_t(i)])) + 0x100000000ull * uint64_t(i)));
    h.push_back(x);
  }
  return h;
}

std::list<PrefixCache::Entry>::iterator PrefixCache::find(uint64_t hash,
                                                          const std::vector<int32_t>& tokens,
                                                          int64_t n) {
  auto [lo, hi] = index_.equal_range(hash);
  for (auto it = lo; it != hi; ++it) {
    const Entry& e = *it->second;
    if (int64_t(e.tokens.size()) == n &&
        std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin()))
      return it->second;
  }
  return lru_.end();
}

std::pair<int64_t, int> PrefixCache::lookup(const std::vector<int32_t>& tokens, int64_t limit) {
  if (!enabled()) return {0, -1};
  limit = std::min<int64_t>(limit, int64_t(tokens.size()));
  const std::vector<uint64_t> h = chain(tokens, limit);
  for (int64_t k = int64_t(h.size()) - 1; k >= 0; --k) {
    auto it = find(h[size_t(k)], tokens, (k + 1) * block_);
    if (it == lru_.end()) continue;
    lru_.splice(lru_.begin(), lru_, it);  // most recently used
    return {(k + 1) * block_, it->seq};
  }
  return {0, -1};
}

int64_t PrefixCache::peek(const std::vector<int32_t>& tokens, int64_t limit) {
  if (!enabled()) return 0;
  limit = std::min<int64_t>(limit, int64_t(tokens.size()));
  const std::vector<uint64_t> h = chain(tokens, limit);
  for (int64_t k = int64_t(h.size()) - 1; k >= 0; --k)
    if (find(h[size_t(k)], tokens, (k + 1) * block_) != lru_.end()) return (k + 1) * block_;
  return 0;
}

bool PrefixCache::contains(const std::vector<int32_t>& tokens) const {
  const int64_t n = int64_t(tokens.size());
  if (!enabled() || n == 0 || n % block_) return false;
  const uint64_t h = chain(tokens, n).back();
  auto [lo, hi] = index_.equal_range(h);
  for (auto it = lo; it != hi; ++it)
    if (it->second->tokens == tokens) return true;
  return false;
}

bool PrefixCache::insert(const std::vector<int32_t>& tokens, int seq) {
  const int64_t n = int64_t(tokens.size());
  DSV4_CHECK(n > 0 && n % block_ == 0 && runner_.length(seq) == n,
             "prefix cache: a snapshot is taken at a block boundary of the sequence");
  if (!enabled() || contains(tokens)) return false;
  while (int(lru_.size()) >= max_ || !runner_.can_open_on(dp_rank_))
    if (!evict_one()) return false;
  Entry e{chain(tokens, n).back(), tokens, runner_.fork_sequence(seq)};
  lru_.push_front(std::move(e));
  index_.emplace(lru_.front().hash, lru_.begin());
  return true;
}

std::vector<int> PrefixCache::sequences() const {
  std::vector<int> s;
  for (const Entry& e : lru_) s.push_back(e.seq);
  return s;
}

bool PrefixCache::evict_one() {
  if (lru_.empty()) return false;
  auto last = std::prev(lru_.end());
  auto [lo, hi] = index_.equal_range(last->hash);
  for (auto it = lo; it != hi; ++it)
    if (it->second == last) {
      index_.erase(it);
      break;
    }
  runner_.close_sequence(last->seq);
  lru_.erase(last);
  return true;
}

}  // namespace dsv4
