#include "tokenizer/bpe.h"

#include <queue>

#include "core/error.h"

namespace dsv4::tok {
namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}

// Pieces up to this many bytes are merged by rescanning all pairs (fast for short words);
// longer ones (whitespace runs, long CJK runs) through a priority queue.
constexpr size_t kSmallPiece = 48;

}  // namespace

BytePairEncoder::BytePairEncoder(const std::vector<int32_t>& byte_token) : byte_token_(byte_token) {
  DSV4_CHECK(byte_token_.size() == 256, "BPE needs a token for each of the 256 bytes");
  merges_.reserve(1 << 18);
}

void BytePairEncoder::add_merge(int32_t left, int32_t right, int32_t merged, int32_t rank) {
  merges_.insert_or_assign(pair_key(left, right), Merge{rank, merged});
}

const BytePairEncoder::Merge* BytePairEncoder::find_merge(int32_t left, int32_t right) const {
  auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

void BytePairEncoder::merge_small(std::vector<int32_t>& ids) const {
  // ranks[i]: rank of the merge of (ids[i], ids[i+1]), or INT32_MAX for none.
  std::vector<int32_t> ranks(ids.size(), INT32_MAX);
  auto rank_at = [&](size_t i) {
    const Merge* m = find_merge(ids[i], ids[i + 1]);
    return m ? m->rank : INT32_MAX;
  };
  for (size_t i = 0; i + 1 < ids.size(); ++i) ranks[i] = rank_at(i);
  while (ids.size() > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < ids.size(); ++i)
      if (ranks[i] < ranks[best]) best = i;
    if (ranks[best] == INT32_MAX) break;
    ids[best] = find_merge(ids[best], ids[best + 1])->merged;
    ids.erase(ids.begin() + std::ptrdiff_t(best) + 1);
    ranks.erase(ranks.begin() + std::ptrdiff_t(best) + 1);
    ranks.back() = INT32_MAX;
    if (best + 1 < ids.size())
      ranks[best] = rank_at(best);
    else
      ranks[best] = INT32_MAX;
    if (best > 0) ranks[best - 1] = rank_at(best - 1);
  }
}

void BytePairEncoder::merge_large(std::vector<int32_t>& ids) const {
  // Symbols form a linked list over their starting positions; the queue holds candidate
  // merges ordered by (rank, position). Entries made stale by an earlier merge are skipped.
  const int n = int(ids.size());
  std::vector<int> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t left, right;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto offer = [&](int pos) {
    if (pos < 0 || next[pos] < 0) return;
    const int32_t l = ids[pos], r = ids[next[pos]];
    if (const Merge* m = find_merge(l, r)) queue.push({m->rank, pos, l, r});
  };
  for (int i = 0; i + 1 < n; ++i) offer(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    if (!alive[c.pos] || next[c.pos] < 0) continue;
    const int right = next[c.pos];
    if (ids[c.pos] != c.left || ids[right] != c.right) continue;
    ids[c.pos] = find_merge(c.left, c.right)->merged;
    alive[right] = false;
    next[c.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = c.pos;
    offer(prev[c.pos]);
    offer(c.pos);
  }
  size_t out = 0;
  for (int i = 0; i >= 0 && i < n; i = next[i]) ids[out++] = ids[i];
  ids.resize(out);
}

void BytePairEncoder::encode(std::string_view piece, std::vector<int32_t>& out) const {
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (auto it = cache_.find(piece); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) ids[i] = byte_token_[static_cast<uint8_t>(piece[i])];
  if (ids.size() <= kSmallPiece)
    merge_small(ids);
  else
    merge_large(ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() >= kCacheCapacity) cache_.clear();
    cache_.emplace(std::string(piece), std::move(ids));
  }
}

}  // namespace dsv4::tok
