// Page bookkeeping for the paged cache stores, independent of where the bytes live.
//
// A page id is shared by all layers of its kind (one block table per kind per sequence, as
// vLLM does); each layer has its own bytes for that page. Compressor states are fixed-size,
// one slot per sequence. Compressed pages (C4, C128) are reference-counted: a fork shares the
// source's pages, and the first sequence to write into a shared page gets a private copy
// (copy-on-write; the backend copies the bytes). Window pages and state slots are never
// shared: a fork gets its own, which the backend fills with copies of the source's.
//
// Capacity queries never throw; the mutations throw dsv4::Error naming the exhausted store and
// change nothing when they do.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "kvcache/cache_spec.h"

namespace dsv4 {

// A sequence's block tables and progress.
struct SequenceCache {
  int64_t tokens = 0;      // positions processed by the decoder layers
  int64_t mtp_tokens = 0;  // positions processed by the MTP block(s)
  int state_slot = -1;
  std::vector<int> pages[kNumPageKinds];
};

// A page a sequence must copy before writing into it: every layer's bytes of page `from`
// into page `to` (compressed KV and, on C4 pages, the indexer keys).
struct PageCopy {
  PageKind kind = PageKind::kC4;
  int from = -1, to = -1;
};

class BlockManager {
 public:
  BlockManager(const CacheSpec& spec, const CacheConfig& config);

  const CacheConfig& config() const { return config_; }
  const CacheSpec& spec() const { return spec_; }
  int free_pages(PageKind k) const { return static_cast<int>(free_[int(k)].size()); }
  int total_pages(PageKind k) const { return config_.pages[int(k)]; }
  int free_state_slots() const { return static_cast<int>(free_slots_.size()); }
  int refcount(PageKind k, int page) const { return refs_[int(k)].at(page); }

  // Room for one more sequence (a state slot and its window pages).
  bool can_begin() const;
  // Room for `seq` to grow by `n` tokens: the compressed pages it needs, copies of shared
  // pages it would write into included.
  bool can_append(const SequenceCache& seq, int64_t n) const;
  // Pages of kind `k` that growing `seq` by `n` tokens takes from the pool (new + copies).
  int64_t pages_to_append(const SequenceCache& seq, int64_t n, PageKind k) const;

  // A new sequence: window pages and a state slot.
  SequenceCache begin_sequence();
  // A sequence at `src`'s length sharing its compressed pages, with its own window pages and
  // state slot (the caller copies their contents).
  SequenceCache fork(const SequenceCache& src);
  // Makes room for the sequence to reach `total_tokens`: new compressed pages, and private
  // copies of the shared pages it will write into (returned: the caller copies their bytes
  // before writing). All or nothing.
  std::vector<PageCopy> reserve(SequenceCache& seq, int64_t total_tokens);
  // Returns the compressed pages a sequence of `tokens` tokens does not need (reserved for
  // tokens it dropped: speculative decoding's rejected drafts) and sets its length.
  void truncate(SequenceCache& seq, int64_t tokens);
  // Returns the sequence's references; pages nobody else holds go back to the pool.
  void end_sequence(SequenceCache& seq);

  int64_t entries_needed(PageKind k, int64_t tokens) const { return spec_.entries(k, tokens); }
  int64_t pages_needed(PageKind k, int64_t tokens) const;

 private:
  int take(PageKind k);
  void release(PageKind k, int page);
  // [first, last + 1) indices in seq's table of the pages that growing to `total_tokens`
  // writes entries into.
  std::pair<int64_t, int64_t> written_pages(const SequenceCache& seq, PageKind k,
                                            int64_t total_tokens) const;

  CacheSpec spec_;
  CacheConfig config_;
  std::vector<int> free_[kNumPageKinds];
  std::vector<int> refs_[kNumPageKinds];
  std::vector<int> free_slots_;
};

}  // namespace dsv4
