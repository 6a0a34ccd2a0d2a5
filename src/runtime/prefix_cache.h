// The prefix cache, DeepSeek-V4 aware. A cached prefix is a snapshot: a runner sequence forked
// from a request's at a boundary L (a multiple of `block` tokens) and never stepped again. It
// holds everything a cold run would have at L: the compressed KV and indexer-key pages of
// positions < L (shared with the requests that use them, reference-counted, copy-on-write
// where a request writes into a partly filled one), and its own copies of the 128-slot window
// ring of every block and of the compressor states (the CSA states keep the previous block's
// rows, which the next compressed entry pools). A hit forks the snapshot, so the request
// resumes exactly where a cold run would be: on the CPU backend bit for bit.
//
// Content-addressed by a hash chain over the token ids of each block (verified against the
// stored tokens, so a collision is never a hit); least recently used snapshots are evicted
// when their slots or pages are needed. Each snapshot costs a state slot and the window pages
// (V4-Flash: 44 blocks x 128 slots x 584 B = 3.3 MB of window, 12 MB of compressor states).
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

#include "model/runner.h"

namespace dsv4 {

class PrefixCache {
 public:
  // `max_snapshots` 0: off. Snapshots of the sequences of data-parallel rank `dp_rank`.
  PrefixCache(Runner& runner, int block, int max_snapshots, int dp_rank = 0);
  ~PrefixCache();

  bool enabled() const { return max_ > 0; }
  int block() const { return block_; }
  int size() const { return int(lru_.size()); }
  int capacity() const { return max_; }

  // The longest cached prefix of tokens[0, limit): its length (a multiple of block, <= limit)
  // and snapshot sequence, or {0, -1}. A hit counts as a use (LRU).
  std::pair<int64_t, int> lookup(const std::vector<int32_t>& tokens, int64_t limit);
  // The length lookup() would find, without counting a use.
  int64_t peek(const std::vector<int32_t>& tokens, int64_t limit);
  // Snapshots `seq` (at length tokens.size(), a multiple of block) unless that prefix is
  // cached already; evicts the least recently used snapshot when full. False when the runner
  // has no slot or window pages for it even after evicting.
  bool insert(const std::vector<int32_t>& tokens, int seq);
  bool contains(const std::vector<int32_t>& tokens) const;
  // The snapshots' runner sequences.
  std::vector<int> sequences() const;
  // Drops the least recently used snapshot; false when none is left.
  bool evict_one();
  void clear();

 private:
  struct Entry {
    uint64_t hash;
    std::vector<int32_t> tokens;
    int seq;
  };
  // Hash of each block boundary of tokens[0, n): h[k] covers tokens[0, (k + 1) * block).
  std::vector<uint64_t> chain(const std::vector<int32_t>& tokens, int64_t n) const;
  std::list<Entry>::iterator find(uint64_t hash, const std::vector<int32_t>& tokens, int64_t n);

  Runner& runner_;
  int dp_rank_ = 0;
  int block_ = 256;
  int max_ = 0;
  std::list<Entry> lru_;  // most recently used first
  std::unordered_multimap<uint64_t, std::list<Entry>::iterator> index_;
};

}  // namespace dsv4
