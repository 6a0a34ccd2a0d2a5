// Device views of the paged cache stores, in the byte layout of runtime/cache_layout.h (the
// same bytes as the CPU backend's HostCache): kernels address an entry through a sequence's
// block table exactly as HostCache does.
#pragma once

#include <cstdint>

#include "kvcache/cache_layout.h"

namespace dsv4::cuda {

// One layer's paged store of 584-byte KV entries (window ring or compressed entries) or of
// MXFP4 indexer keys. Entry i of sequence s lives on page block_table[s * stride + i / page_size]
// at slot i % page_size; a page is [page_size x data_bytes][page_size x scale_bytes], padded.
struct PagedStoreView {
  uint8_t* pages = nullptr;  // this layer's pages
  int64_t page_bytes = 0;
  int page_size = 0;                     // entries per page
  int data_bytes = 0;                    // per entry (576 KV, 64 indexer keys)
  int scale_bytes = 0;                   // per entry (8 KV, 4 indexer keys)
  const int32_t* block_table = nullptr;  // [num_seqs, stride] page ids
  int stride = 0;
};

inline PagedStoreView kv_store_view(uint8_t* pages, int page_size, const int32_t* table, int stride,
                                    const KvEntryLayout& l = KvEntryLayout{}) {
  return {pages, l.page_bytes(page_size), page_size, l.data_bytes(), l.scale_bytes(), table,
          stride};
}
inline PagedStoreView index_store_view(uint8_t* pages, int page_size, const int32_t* table,
                                       int stride, const IndexKeyLayout& l = IndexKeyLayout{}) {
  return {pages, l.page_bytes(page_size), page_size, l.data_bytes(), l.scale_bytes(), table,
          stride};
}

#if defined(__CUDACC__)
// Data and scale bytes of entry `i` of sequence `s`.
__device__ __forceinline__ uint8_t* entry_data(const PagedStoreView& v, int s, int64_t i) {
  const int page = v.block_table[int64_t(s) * v.stride + i / v.page_size];
  return v.pages + int64_t(page) * v.page_bytes + int64_t(i % v.page_size) * v.data_bytes;
}
__device__ __forceinline__ uint8_t* entry_scales(const PagedStoreView& v, int s, int64_t i) {
  const int page = v.block_table[int64_t(s) * v.stride + i / v.page_size];
  return v.pages + int64_t(page) * v.page_bytes + int64_t(v.page_size) * v.data_bytes +
         int64_t(i % v.page_size) * v.scale_bytes;
}
#endif

}  // namespace dsv4::cuda
