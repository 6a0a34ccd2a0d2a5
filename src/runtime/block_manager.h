// Page bookkeeping for the paged cache stores, independent of where the bytes live.
//
// Stores (see cache_layout.h): every block (decoder layers and MTP) has a sliding-window KV
// ring of `window_size` slots; CSA blocks (ratio 4) have compressed KV and indexer keys, one
// entry per 4 tokens, sharing page ids; HCA blocks (ratio 128) have compressed KV, one entry
// per 128 tokens. A page id is shared by all layers of its kind (one block table per kind per
// sequence, as vLLM does); each layer has its own bytes for that page. Compressor states are
// fixed-size, one slot per sequence.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace dsv4 {

enum class PageKind { kWindow = 0, kC4 = 1, kC128 = 2 };
constexpr int kNumPageKinds = 3;

struct CacheConfig {
  int page_size = 64;  // entries per page, every paged store
  int max_seqs = 4;    // compressor-state slots = sequences alive at once
  int pages[kNumPageKinds] = {0, 0, 0};

  // Enough pages for `max_seqs` sequences of up to `max_tokens` tokens each.
  static CacheConfig for_capacity(const ModelConfig& m, int max_seqs, int64_t max_tokens,
                                  int page_size);
};

// A sequence's block tables and progress.
struct SequenceCache {
  int64_t tokens = 0;      // positions processed by the decoder layers
  int64_t mtp_tokens = 0;  // positions processed by the MTP block(s)
  int state_slot = -1;
  std::vector<int> pages[kNumPageKinds];
};

class BlockManager {
 public:
  BlockManager(const ModelConfig& model, const CacheConfig& config);

  const CacheConfig& config() const { return config_; }
  int free_pages(PageKind k) const { return static_cast<int>(free_[int(k)].size()); }
  int free_state_slots() const { return static_cast<int>(free_slots_.size()); }

  // Allocates the window pages and a state slot. Throws dsv4::Error when the pool is full.
  SequenceCache begin_sequence();
  // Makes room for the sequence to reach `total_tokens` (compressed entries it will need);
  // all-or-nothing. Throws dsv4::Error naming the exhausted store.
  void reserve(SequenceCache& seq, int64_t total_tokens);
  void end_sequence(SequenceCache& seq);

  // Entries a sequence of `tokens` tokens keeps in each paged store.
  int64_t entries_needed(PageKind k, int64_t tokens) const;
  int64_t pages_needed(PageKind k, int64_t tokens) const;

 private:
  int take(PageKind k);

  CacheConfig config_;
  int window_size_ = 0;
  bool has_c4_ = false, has_c128_ = false;
  std::vector<int> free_[kNumPageKinds];
  std::vector<int> free_slots_;
};

std::string page_kind_name(PageKind k);

}  // namespace dsv4
