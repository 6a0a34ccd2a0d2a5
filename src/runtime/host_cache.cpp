#include "runtime/host_cache.h"

#include <algorithm>
#include <limits>

#include "core/error.h"

namespace dsv4 {

HostCache::HostCache(const ModelConfig& m, const CacheConfig& c)
    : model_(m), page_size_(c.page_size), max_seqs_(c.max_seqs) {
  kv_.nope_dim = m.nope_head_dim();
  kv_.rope_dim = m.rope_head_dim;
  ix_.dim = m.index_head_dim > 0 ? m.index_head_dim : 128;
  kv_page_bytes_ = kv_.page_bytes(page_size_);
  ix_page_bytes_ = ix_.page_bytes(page_size_);
  const int nb = m.num_blocks();
  window_.resize(nb);
  compressed_.resize(nb);
  index_keys_.resize(nb);
  main_state_.resize(nb);
  index_state_.resize(nb);
  for (int b = 0; b < nb; ++b) {
    window_[b].assign(size_t(c.pages[int(PageKind::kWindow)]) * kv_page_bytes_, 0);
    const int r = m.ratio(b);
    if (r > 0) {
      compressed_[b].assign(size_t(c.pages[int(compressed_kind(b))]) * kv_page_bytes_, 0);
      main_state_[b].assign(size_t(max_seqs_) * main_state_layout(b).floats(), 0.0f);
    }
    if (r == 4) {
      index_keys_[b].assign(size_t(c.pages[int(PageKind::kC4)]) * ix_page_bytes_, 0);
      index_state_[b].assign(size_t(max_seqs_) * index_state_layout().floats(), 0.0f);
    }
  }
  for (int s = 0; s < max_seqs_; ++s) reset_states(s);
}

PageKind HostCache::compressed_kind(int block) const {
  return model_.ratio(block) == 4 ? PageKind::kC4 : PageKind::kC128;
}

CompressorStateLayout HostCache::main_state_layout(int block) const {
  return {model_.ratio(block), model_.head_dim};
}

CompressorStateLayout HostCache::index_state_layout() const {
  return {4, ix_.dim};
}

EntryRef HostCache::window_slot(int block, const SequenceCache& s, int64_t pos) {
  const int64_t slot = pos % model_.window_size;
  const auto& table = s.pages[int(PageKind::kWindow)];
  const int64_t pi = slot / page_size_;
  DSV4_CHECK(pi < int64_t(table.size()), "window slot ", slot, " has no page");
  uint8_t* page = window_[block].data() + table[pi] * kv_page_bytes_;
  const int off = static_cast<int>(slot % page_size_);
  return {page + kv_.data_offset(off), page + kv_.scale_offset(page_size_, off)};
}

EntryRef HostCache::compressed(int block, const SequenceCache& s, int64_t i) {
  DSV4_CHECK(model_.ratio(block) > 0, "block ", block, " has no compressed KV");
  const auto& table = s.pages[int(compressed_kind(block))];
  const int64_t pi = i / page_size_;
  DSV4_CHECK(i >= 0 && pi < int64_t(table.size()), "compressed entry ", i, " of block ", block,
             " has no page (", table.size(), " pages reserved)");
  uint8_t* page = compressed_[block].data() + table[pi] * kv_page_bytes_;
  const int off = static_cast<int>(i % page_size_);
  return {page + kv_.data_offset(off), page + kv_.scale_offset(page_size_, off)};
}

EntryRef HostCache::index_key(int block, const SequenceCache& s, int64_t i) {
  DSV4_CHECK(model_.ratio(block) == 4, "block ", block, " has no indexer");
  const auto& table = s.pages[int(PageKind::kC4)];
  const int64_t pi = i / page_size_;
  DSV4_CHECK(i >= 0 && pi < int64_t(table.size()), "indexer key ", i, " of block ", block,
             " has no page");
  uint8_t* page = index_keys_[block].data() + table[pi] * ix_page_bytes_;
  const int off = static_cast<int>(i % page_size_);
  return {page + ix_.data_offset(off), page + ix_.scale_offset(page_size_, off)};
}

float* HostCache::main_state(int block, int slot) {
  DSV4_CHECK(model_.ratio(block) > 0 && slot >= 0 && slot < max_seqs_, "bad state access");
  return main_state_[block].data() + size_t(slot) * main_state_layout(block).floats();
}

float* HostCache::index_state(int block, int slot) {
  DSV4_CHECK(model_.ratio(block) == 4 && slot >= 0 && slot < max_seqs_, "bad state access");
  return index_state_[block].data() + size_t(slot) * index_state_layout().floats();
}

void HostCache::reset_states(int slot) {
  auto reset = [](float* st, const CompressorStateLayout& l) {
    std::fill(st + l.kv_offset(0), st + l.score_offset(0), 0.0f);
    std::fill(st + l.score_offset(0), st + l.floats(), -std::numeric_limits<float>::infinity());
  };
  for (int b = 0; b < model_.num_blocks(); ++b) {
    if (model_.ratio(b) > 0) reset(main_state(b, slot), main_state_layout(b));
    if (model_.ratio(b) == 4) reset(index_state(b, slot), index_state_layout());
  }
}

const uint8_t* HostCache::page_bytes_ptr(int block, PageKind kind, int page,
                                         bool index_keys) const {
  if (index_keys) return index_keys_[block].data() + page * ix_page_bytes_;
  if (kind == PageKind::kWindow) return window_[block].data() + page * kv_page_bytes_;
  return compressed_[block].data() + page * kv_page_bytes_;
}

}  // namespace dsv4
