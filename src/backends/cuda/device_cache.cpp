#include "backends/cuda/device_cache.h"

#include "model/cache_spec.h"
#include "model/speculation.h"

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/compressor/compressor.h"

namespace dsv4 {
int64_t DeviceCache::bytes_needed(const ModelConfig& m, const CacheConfig& c) {
  return cache_bytes(m, c) + device_mtp_state_bytes(m, c.max_seqs);
}

namespace {

int window_pages_per_seq(const ModelConfig& m, const CacheConfig& c) {
  return (m.window_size + c.page_size - 1) / c.page_size;
}

// The allocated layout: the pool's stores grown by the extra sequences' slots and window pages
// at their ends (each store is slot- or page-major, so the pool's part is a prefix of it).
CacheConfig with_extra(const ModelConfig& m, CacheConfig c, int extra_seqs) {
  c.max_seqs += extra_seqs;
  c.pages[int(PageKind::kWindow)] += extra_seqs * window_pages_per_seq(m, c);
  return c;
}

}  // namespace

std::vector<int> DeviceCache::extra_window_pages(int i) const {
  DSV4_CHECK(i >= 0 && config_.max_seqs + i < slots_, "device cache: no extra sequence ", i);
  const int n = window_pages_per_seq(model_, config_);
  std::vector<int> pages;
  for (int j = 0; j < n; ++j) pages.push_back(config_.pages[int(PageKind::kWindow)] + i * n + j);
  return pages;
}

DeviceCache::DeviceCache(const ModelConfig& m, const CacheConfig& pool, int extra_seqs)
    : model_(m), config_(pool), kv_(dsv4::kv_layout(m)), ix_(dsv4::index_layout(m)) {
  DSV4_CHECK(pool.page_size > 0 && pool.max_seqs > 0 && extra_seqs >= 0,
             "device cache: bad configuration");
  const CacheConfig c = with_extra(m, pool, extra_seqs);
  slots_ = c.max_seqs;
  kv_page_bytes_ = kv_.page_bytes(c.page_size);
  ix_page_bytes_ = ix_.page_bytes(c.page_size);
  bytes_ = bytes_needed(m, c);
  memory_ = cuda::DeviceBuffer<uint8_t>(size_t(bytes_));
  memory_.fill_bytes(0);
  stores_.resize(m.num_blocks());
  uint8_t* p = memory_.data();
  auto take = [&](int64_t n, bool exists) {
    uint8_t* q = exists ? p : nullptr;
    p += cache_alloc_bytes(n, exists);
    return q;
  };
  for (int b = 0; b < m.num_blocks(); ++b) {
    const CacheStoreBytes s = cache_store_bytes(m, c, b);
    const int r = m.ratio(b);
    stores_[b].window = take(s.window, true);
    stores_[b].compressed = take(s.compressed, r > 0);
    stores_[b].index_keys = take(s.index_keys, r == 4);
    stores_[b].main_state = reinterpret_cast<float*>(take(s.main_state, r > 0));
    stores_[b].index_state = reinterpret_cast<float*>(take(s.index_state, r == 4));
  }
  // The MTP state after the stores (zero-filled with them).
  if (m.n_mtp_layers > 0) mtp_hidden_ = reinterpret_cast<__nv_bfloat16*>(p);
  DSV4_CHECK(p + device_mtp_state_bytes(m, c.max_seqs) <= memory_.data() + bytes_,
             "device cache: layout exceeds its allocation");
  slot_scratch_ = cuda::DeviceBuffer<int32_t>(size_t(c.max_seqs));
  for (int s = 0; s < c.max_seqs; ++s) reset_states(s, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
}

CompressorStateLayout DeviceCache::main_state_layout(int block) const {
  return dsv4::main_state_layout(model_, block);
}

PageKind DeviceCache::compressed_kind(int block) const {
  return dsv4::compressed_kind(model_, block);
}

cuda::PagedStoreView DeviceCache::window_view(int block, const int32_t* table, int stride) const {
  return cuda::kv_store_view(window_pages(block), page_size(), table, stride, kv_);
}

cuda::PagedStoreView DeviceCache::compressed_view(int block, const int32_t* table,
                                                  int stride) const {
  return cuda::kv_store_view(compressed_pages(block), page_size(), table, stride, kv_);
}

cuda::PagedStoreView DeviceCache::index_view(int block, const int32_t* table, int stride) const {
  return cuda::index_store_view(index_pages(block), page_size(), table, stride, ix_);
}

EntryRef DeviceCache::window_slot(int block, const SequenceCache& s, int64_t pos) const {
  const int64_t slot = pos % model_.window_size;
  const auto& table = s.pages[int(PageKind::kWindow)];
  const int64_t pi = slot / page_size();
  DSV4_CHECK(pi < int64_t(table.size()), "window slot ", slot, " has no page");
  uint8_t* page = window_pages(block) + table[pi] * kv_page_bytes_;
  const int off = static_cast<int>(slot % page_size());
  return {page + kv_.data_offset(off), page + kv_.scale_offset(page_size(), off)};
}

EntryRef DeviceCache::compressed(int block, const SequenceCache& s, int64_t i) const {
  DSV4_CHECK(model_.ratio(block) > 0, "block ", block, " has no compressed KV");
  const auto& table = s.pages[int(compressed_kind(block))];
  const int64_t pi = i / page_size();
  DSV4_CHECK(i >= 0 && pi < int64_t(table.size()), "compressed entry ", i, " of block ", block,
             " has no page");
  uint8_t* page = compressed_pages(block) + table[pi] * kv_page_bytes_;
  const int off = static_cast<int>(i % page_size());
  return {page + kv_.data_offset(off), page + kv_.scale_offset(page_size(), off)};
}

EntryRef DeviceCache::index_key(int block, const SequenceCache& s, int64_t i) const {
  DSV4_CHECK(model_.ratio(block) == 4, "block ", block, " has no indexer");
  const auto& table = s.pages[int(PageKind::kC4)];
  const int64_t pi = i / page_size();
  DSV4_CHECK(i >= 0 && pi < int64_t(table.size()), "indexer key ", i, " of block ", block,
             " has no page");
  uint8_t* page = index_pages(block) + table[pi] * ix_page_bytes_;
  const int off = static_cast<int>(i % page_size());
  return {page + ix_.data_offset(off), page + ix_.scale_offset(page_size(), off)};
}

float* DeviceCache::main_state(int block, int slot) const {
  DSV4_CHECK(model_.ratio(block) > 0 && slot >= 0 && slot < slots_, "bad state access");
  return main_states(block) + size_t(slot) * main_state_layout(block).floats();
}

float* DeviceCache::index_state(int block, int slot) const {
  DSV4_CHECK(model_.ratio(block) == 4 && slot >= 0 && slot < slots_, "bad state access");
  return index_states(block) + size_t(slot) * index_state_layout().floats();
}

__nv_bfloat16* DeviceCache::mtp_hidden(int slot) const {
  DSV4_CHECK(mtp_hidden_ && slot >= 0 && slot < slots_, "bad MTP state access");
  return mtp_hidden_pool() + size_t(slot) * model_.hc_mult * model_.dim;
}

std::pair<const uint8_t*, int64_t> DeviceCache::store_range(int block, int kind) const {
  const CacheStoreBytes s = cache_store_bytes(model_, config_, block);
  switch (kind) {
    case 0:
      return {stores_[block].window, s.window};
    case 1:
      return {stores_[block].compressed, s.compressed};
    default:
      return {stores_[block].index_keys, s.index_keys};
  }
}

void DeviceCache::reset_states(int slot, cudaStream_t stream) {
  DSV4_CHECK(slot >= 0 && slot < slots_, "reset_states: slot ", slot);
  int32_t* d_slot = slot_scratch_.data() + slot;
  DSV4_CUDA_CHECK(cudaMemcpyAsync(d_slot, &slot, sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  // The copy reads `slot` from pageable memory before returning, so the local is safe.
  for (int b = 0; b < model_.num_blocks(); ++b) {
    const int r = model_.ratio(b);
    if (r > 0) cuda::compressor_reset_states(main_states(b), d_slot, 1, r, model_.head_dim, stream);
    if (r == 4) cuda::compressor_reset_states(index_states(b), d_slot, 1, 4, ix_.dim, stream);
  }
  if (mtp_hidden_)
    DSV4_CUDA_CHECK(
        cudaMemsetAsync(mtp_hidden(slot), 0, size_t(model_.hc_mult) * model_.dim * 2, stream));
}

void DeviceCache::copy_sequence(const SequenceCache& from, const SequenceCache& to,
                                cudaStream_t stream) {
  const auto& src = from.pages[int(PageKind::kWindow)];
  const auto& dst = to.pages[int(PageKind::kWindow)];
  DSV4_CHECK(src.size() == dst.size(), "copy_sequence: window tables differ");
  auto d2d = [&](void* d, const void* s, int64_t n) {
    DSV4_CUDA_CHECK(cudaMemcpyAsync(d, s, size_t(n), cudaMemcpyDeviceToDevice, stream));
  };
  for (int b = 0; b < model_.num_blocks(); ++b) {
    for (size_t i = 0; i < src.size(); ++i)
      d2d(window_pages(b) + dst[i] * kv_page_bytes_, window_pages(b) + src[i] * kv_page_bytes_,
          kv_page_bytes_);
    if (model_.ratio(b) > 0)
      d2d(main_state(b, to.state_slot), main_state(b, from.state_slot),
          main_state_layout(b).bytes());
    if (model_.ratio(b) == 4)
      d2d(index_state(b, to.state_slot), index_state(b, from.state_slot),
          index_state_layout().bytes());
  }
  if (mtp_hidden_)
    d2d(mtp_hidden(to.state_slot), mtp_hidden(from.state_slot),
        int64_t(model_.hc_mult) * model_.dim * 2);
}

void DeviceCache::copy_page(const PageCopy& c, cudaStream_t stream) {
  DSV4_CHECK(c.kind != PageKind::kWindow, "window pages are never shared");
  for (int b = 0; b < model_.num_blocks(); ++b) {
    if (model_.ratio(b) == 0 || compressed_kind(b) != c.kind) continue;
    DSV4_CUDA_CHECK(cudaMemcpyAsync(compressed_pages(b) + c.to * kv_page_bytes_,
                                    compressed_pages(b) + c.from * kv_page_bytes_,
                                    size_t(kv_page_bytes_), cudaMemcpyDeviceToDevice, stream));
    if (model_.ratio(b) == 4)
      DSV4_CUDA_CHECK(cudaMemcpyAsync(index_pages(b) + c.to * ix_page_bytes_,
                                      index_pages(b) + c.from * ix_page_bytes_,
                                      size_t(ix_page_bytes_), cudaMemcpyDeviceToDevice, stream));
  }
}

void DeviceCache::upload(const HostCache& h) {
  DSV4_CHECK(h.page_size() == page_size(), "device cache upload: page sizes differ");
  for (int b = 0; b < model_.num_blocks(); ++b) {
    const CacheStoreBytes s = cache_store_bytes(model_, config_, b);
    auto copy = [](void* dst, const void* src, int64_t n) {
      if (n) DSV4_CUDA_CHECK(cudaMemcpy(dst, src, size_t(n), cudaMemcpyHostToDevice));
    };
    copy(stores_[b].window, h.page_bytes_ptr(b, PageKind::kWindow, 0, false), s.window);
    if (s.compressed)
      copy(stores_[b].compressed, h.page_bytes_ptr(b, compressed_kind(b), 0, false), s.compressed);
    if (s.index_keys)
      copy(stores_[b].index_keys, h.page_bytes_ptr(b, PageKind::kC4, 0, true), s.index_keys);
    // HostCache hands out its states only through non-const accessors; the object is not
    // const underneath (the caller owns it), only this view of it.
    HostCache& hm = const_cast<HostCache&>(h);
    if (s.main_state) copy(stores_[b].main_state, hm.main_state(b, 0), s.main_state);
    if (s.index_state) copy(stores_[b].index_state, hm.index_state(b, 0), s.index_state);
  }
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
}

void DeviceCache::download(HostCache& h) const {
  DSV4_CHECK(h.page_size() == page_size(), "device cache download: page sizes differ");
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  for (int b = 0; b < model_.num_blocks(); ++b) {
    const CacheStoreBytes s = cache_store_bytes(model_, config_, b);
    auto copy = [](const void* dst, const void* src, int64_t n) {
      // HostCache's page bytes are reachable only as const pointers into its own vectors.
      if (n)
        DSV4_CUDA_CHECK(cudaMemcpy(const_cast<void*>(dst), src, size_t(n), cudaMemcpyDeviceToHost));
    };
    copy(h.page_bytes_ptr(b, PageKind::kWindow, 0, false), stores_[b].window, s.window);
    if (s.compressed)
      copy(h.page_bytes_ptr(b, compressed_kind(b), 0, false), stores_[b].compressed, s.compressed);
    if (s.index_keys)
      copy(h.page_bytes_ptr(b, PageKind::kC4, 0, true), stores_[b].index_keys, s.index_keys);
    if (s.main_state) copy(h.main_state(b, 0), stores_[b].main_state, s.main_state);
    if (s.index_state) copy(h.index_state(b, 0), stores_[b].index_state, s.index_state);
  }
}

}  // namespace dsv4
