#include "backends/cpu/host_cache.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "model/cache_spec.h"

namespace dsv4 {

HostCache::HostCache(const ModelConfig& m, const CacheConfig& c)
    : model_(m), page_size_(c.page_size), max_seqs_(c.max_seqs) {
  kv_ = dsv4::kv_layout(m);
  ix_ = dsv4::index_layout(m);
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
  if (m.n_mtp_layers > 0) mtp_hidden_.assign(size_t(max_seqs_) * m.hc_mult * m.dim, 0.0f);
  for (int s = 0; s < max_seqs_; ++s) reset_states(s);
}

float* HostCache::mtp_hidden(int slot) {
  DSV4_CHECK(!mtp_hidden_.empty() && slot >= 0 && slot < max_seqs_, "bad MTP state access");
  return mtp_hidden_.data() + size_t(slot) * model_.hc_mult * model_.dim;
}

HostCache::Span HostCache::save(const SequenceCache& s, int64_t start, int n, int first, int last) {
  DSV4_CHECK(n >= 0 && n <= model_.window_size && first >= 0 && last <= model_.num_blocks(),
             "bad cache span");
  Span sp;
  sp.first = first, sp.last = last, sp.start = start, sp.n = n;
  for_each_span_store(
      *this, model_, s, sp,
      [&](EntryRef r, int64_t data, int64_t scales) {
        sp.bytes.insert(sp.bytes.end(), r.data, r.data + data);
        sp.bytes.insert(sp.bytes.end(), r.scales, r.scales + scales);
      },
      [&](const float* st, int64_t floats) { sp.states.insert(sp.states.end(), st, st + floats); });
  return sp;
}

std::vector<SavedRange> HostCache::saved_ranges(const SequenceCache& s, const Span& sp) {
  // for_each_span_store's order: the stores' bytes one after another in `bytes` / `states`.
  std::vector<SavedRange> ranges;
  size_t off = 0, soff = 0;
  for_each_span_store(
      *this, model_, s, sp,
      [&](EntryRef r, int64_t data, int64_t scales) {
        ranges.push_back({r.data, sp.bytes.data() + off, data});
        ranges.push_back({r.scales, sp.bytes.data() + off + size_t(data), scales});
        off += size_t(data + scales);
      },
      [&](float* st, int64_t floats) {
        ranges.push_back({reinterpret_cast<const uint8_t*>(st),
                          reinterpret_cast<const uint8_t*>(sp.states.data() + soff),
                          floats * int64_t(sizeof(float))});
        soff += size_t(floats);
      });
  DSV4_CHECK(off == sp.bytes.size() && soff == sp.states.size(),
             "cache span restored into a different layout");
  return ranges;
}

void HostCache::restore(const SequenceCache& s, const Span& sp) {
  for (const SavedRange& r : saved_ranges(s, sp))  // `store` points into this cache's own bytes
    std::copy_n(r.copy, r.bytes, const_cast<uint8_t*>(r.store));
}

void HostCache::restore_rejected(const SequenceCache& s, const Span& sp, int kept) {
  std::vector<SavedRange> ranges = saved_ranges(s, sp);
  std::sort(ranges.begin(), ranges.end(),
            [](const SavedRange& a, const SavedRange& b) { return a.store < b.store; });
  for_each_rejected_store(*this, model_, s, sp, kept, [&](uint8_t* p, int64_t n) {
    std::copy_n(saved_copy_of(ranges, p, n), n, p);
  });
}

PageKind HostCache::compressed_kind(int block) const {
  return dsv4::compressed_kind(model_, block);
}

CompressorStateLayout HostCache::main_state_layout(int block) const {
  return dsv4::main_state_layout(model_, block);
}

CompressorStateLayout HostCache::index_state_layout() const {
  return dsv4::index_state_layout(model_);
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
  if (!mtp_hidden_.empty())
    std::fill_n(mtp_hidden(slot), size_t(model_.hc_mult) * model_.dim, 0.0f);
}

void HostCache::copy_sequence(const SequenceCache& from, const SequenceCache& to) {
  const auto& src = from.pages[int(PageKind::kWindow)];
  const auto& dst = to.pages[int(PageKind::kWindow)];
  DSV4_CHECK(src.size() == dst.size(), "copy_sequence: window tables differ");
  for (int b = 0; b < model_.num_blocks(); ++b) {
    for (size_t i = 0; i < src.size(); ++i)
      std::copy_n(window_[b].data() + src[i] * kv_page_bytes_, kv_page_bytes_,
                  window_[b].data() + dst[i] * kv_page_bytes_);
    if (model_.ratio(b) > 0)
      std::copy_n(main_state(b, from.state_slot), main_state_layout(b).floats(),
                  main_state(b, to.state_slot));
    if (model_.ratio(b) == 4)
      std::copy_n(index_state(b, from.state_slot), index_state_layout().floats(),
                  index_state(b, to.state_slot));
  }
  if (!mtp_hidden_.empty())
    std::copy_n(mtp_hidden(from.state_slot), size_t(model_.hc_mult) * model_.dim,
                mtp_hidden(to.state_slot));
}

void HostCache::copy_page(const PageCopy& c) {
  DSV4_CHECK(c.kind != PageKind::kWindow, "window pages are never shared");
  for (int b = 0; b < model_.num_blocks(); ++b) {
    if (model_.ratio(b) == 0 || compressed_kind(b) != c.kind) continue;
    uint8_t* kv = compressed_[b].data();
    std::copy_n(kv + c.from * kv_page_bytes_, kv_page_bytes_, kv + c.to * kv_page_bytes_);
    if (model_.ratio(b) == 4) {
      uint8_t* ix = index_keys_[b].data();
      std::copy_n(ix + c.from * ix_page_bytes_, ix_page_bytes_, ix + c.to * ix_page_bytes_);
    }
  }
}

const uint8_t* HostCache::page_bytes_ptr(int block, PageKind kind, int page,
                                         bool index_keys) const {
  if (index_keys) return index_keys_[block].data() + page * ix_page_bytes_;
  if (kind == PageKind::kWindow) return window_[block].data() + page * kv_page_bytes_;
  return compressed_[block].data() + page * kv_page_bytes_;
}

}  // namespace dsv4
