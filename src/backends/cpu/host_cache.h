// The bytes of every cache store in host memory (the CPU backend's cache), addressed through
// a sequence's block tables with the shared layout of cache_layout.h.
#pragma once

#include <cstdint>
#include <vector>

#include "kvcache/block_manager.h"
#include "kvcache/cache_layout.h"
#include "model/model_config.h"
#include "model/speculation.h"

namespace dsv4 {

struct EntryRef {
  uint8_t* data = nullptr;
  uint8_t* scales = nullptr;
};

class HostCache {
 public:
  HostCache(const ModelConfig& model, const CacheConfig& config);

  const KvEntryLayout& kv_layout() const { return kv_; }
  const IndexKeyLayout& index_layout() const { return ix_; }
  CompressorStateLayout main_state_layout(int block) const;
  CompressorStateLayout index_state_layout() const;
  int page_size() const { return page_size_; }
  int main_window() const { return model_.window_size; }

  // Ring slot pos % window of block's sliding window.
  EntryRef window_slot(int block, const SequenceCache& s, int64_t pos);
  // Compressed entry i of a CSA/HCA block.
  EntryRef compressed(int block, const SequenceCache& s, int64_t i);
  // Indexer key i of a CSA block.
  EntryRef index_key(int block, const SequenceCache& s, int64_t i);
  // Compressor state (kv rows then score rows) of the sequence's slot.
  float* main_state(int block, int slot);
  float* index_state(int block, int slot);

  // The main model's last-layer streams [hc, dim] at the sequence's last position, kept for
  // the MTP block (which runs a position once the token after it is known); MTP models only.
  float* mtp_hidden(int slot);

  // What a forward over positions [start, start + n) of blocks [first, last) overwrites: the
  // window-ring slots, the compressed entries and indexer keys those positions complete, and
  // the compressor states. restore() puts the bytes back (speculative decoding's rollback).
  struct Span : CacheSpan {
    std::vector<uint8_t> bytes;
    std::vector<float> states;
  };
  Span save(const SequenceCache& s, int64_t start, int n, int first, int last);
  void restore(const SequenceCache& s, const Span& span);
  // Puts back only what the span's positions after the first `kept` changed
  // (for_each_rejected_store, model/speculation.h: Rollback::kRestore).
  void restore_rejected(const SequenceCache& s, const Span& span, int kept);

  // kv = 0, score = -inf in every compressor state of `slot`: a fresh sequence.
  void reset_states(int slot);
  // `to` continues where `from` stands: its window pages and compressor states copied.
  void copy_sequence(const SequenceCache& from, const SequenceCache& to);
  // Every layer's bytes of a page (compressed KV, and indexer keys on C4 pages).
  void copy_page(const PageCopy& c);

  // Bytes of one page of a store, for byte-level comparisons.
  const uint8_t* page_bytes_ptr(int block, PageKind kind, int page, bool index_keys) const;

 private:
  // Each store of the span (for_each_span_store) with where its saved bytes sit in `span`.
  std::vector<SavedRange> saved_ranges(const SequenceCache& s, const Span& span);

  PageKind compressed_kind(int block) const;

  const ModelConfig& model_;
  int page_size_ = 0;
  KvEntryLayout kv_;
  IndexKeyLayout ix_;
  int64_t kv_page_bytes_ = 0, ix_page_bytes_ = 0;
  // Per block.
  std::vector<std::vector<uint8_t>> window_, compressed_, index_keys_;
  std::vector<std::vector<float>> main_state_, index_state_;
  std::vector<float> mtp_hidden_;  // [max_seqs, hc, dim]
  int max_seqs_ = 0;
};

}  // namespace dsv4
