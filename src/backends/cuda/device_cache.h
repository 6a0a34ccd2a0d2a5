// The cache stores in device memory: byte for byte the layout of HostCache (cache_layout.h) —
// the same per-block page arrays (window ring, compressed KV, indexer keys) with the same
// page counts, and the same fp32 compressor-state slots — so the two can be copied into each
// other and compared byte for byte. Page ids come from the same BlockManager bookkeeping.
// One device allocation, zero-filled, every state slot reset (kv 0, score -inf) at creation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "backends/cpu/host_cache.h"
#include "kvcache/block_manager.h"
#include "kvcache/cache_layout.h"
#include "model/model_config.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/common/paged_cache.h"

namespace dsv4 {

class DeviceCache {
 public:
  // `extra_seqs`: state slots and window pages for that many sequences past the pool's
  // (config.max_seqs ..., window pages config.pages[window] ...), which the block manager never
  // hands out (the CUDA runner's padding rows). config(), upload, download and store_range
  // cover the pool alone.
  DeviceCache(const ModelConfig& model, const CacheConfig& config, int extra_seqs = 0);

  // Device bytes a cache of this configuration takes (what the constructor allocates without
  // extra sequences): the stores (cache_bytes) and the MTP state (device_mtp_state_bytes).
  static int64_t bytes_needed(const ModelConfig& model, const CacheConfig& config);

  const CacheConfig& config() const { return config_; }
  // The state slot and window pages of extra sequence i.
  int extra_slot(int i) const { return config_.max_seqs + i; }
  std::vector<int> extra_window_pages(int i) const;
  const KvEntryLayout& kv_layout() const { return kv_; }
  const IndexKeyLayout& index_layout() const { return ix_; }
  CompressorStateLayout main_state_layout(int block) const;
  CompressorStateLayout index_state_layout() const { return {4, ix_.dim}; }
  int page_size() const { return config_.page_size; }
  int64_t kv_page_bytes() const { return kv_page_bytes_; }
  int64_t index_page_bytes() const { return ix_page_bytes_; }

  // Per-block page arrays and state pools (null where the block has no such store).
  uint8_t* window_pages(int block) const { return stores_[block].window; }
  uint8_t* compressed_pages(int block) const { return stores_[block].compressed; }
  uint8_t* index_pages(int block) const { return stores_[block].index_keys; }
  float* main_states(int block) const { return stores_[block].main_state; }
  float* index_states(int block) const { return stores_[block].index_state; }
  PageKind compressed_kind(int block) const;

  // Kernel views through a device block table of `stride` page ids per sequence.
  cuda::PagedStoreView window_view(int block, const int32_t* table, int stride) const;
  cuda::PagedStoreView compressed_view(int block, const int32_t* table, int stride) const;
  cuda::PagedStoreView index_view(int block, const int32_t* table, int stride) const;

  // Device addresses of one entry, addressed exactly as HostCache does (for checks and tests).
  EntryRef window_slot(int block, const SequenceCache& s, int64_t pos) const;
  EntryRef compressed(int block, const SequenceCache& s, int64_t i) const;
  EntryRef index_key(int block, const SequenceCache& s, int64_t i) const;
  float* main_state(int block, int slot) const;
  float* index_state(int block, int slot) const;

  // The main model's last-layer streams [hc, dim] BF16 at the sequence's last position, kept
  // for the MTP block (HostCache::mtp_hidden's role; the device keeps the BF16 streams the
  // CUDA forward computed); MTP models only. Zero for a fresh sequence, copied with a fork.
  __nv_bfloat16* mtp_hidden(int slot) const;
  __nv_bfloat16* mtp_hidden_pool() const { return mtp_hidden_; }

  // Device base and size in bytes of block b's store `kind` (0 window, 1 compressed KV,
  // 2 indexer keys), e.g. to copy a whole store to the host at once.
  std::pair<const uint8_t*, int64_t> store_range(int block, int kind) const;

  // A fresh sequence's compressor states in every block (kv 0, score -inf), on `stream`.
  void reset_states(int slot, cudaStream_t stream);
  // `to` continues where `from` stands: window pages and compressor states copied, on `stream`.
  void copy_sequence(const SequenceCache& from, const SequenceCache& to, cudaStream_t stream);
  // Every layer's bytes of a page (compressed KV, and indexer keys on C4 pages), on `stream`.
  void copy_page(const PageCopy& c, cudaStream_t stream);

  // Every store's bytes from / into a HostCache of the same model and configuration.
  void upload(const HostCache& host);
  void download(HostCache& host) const;

  int64_t bytes() const { return bytes_; }

 private:
  struct Stores {
    uint8_t* window = nullptr;
    uint8_t* compressed = nullptr;
    uint8_t* index_keys = nullptr;
    float* main_state = nullptr;
    float* index_state = nullptr;
  };

  ModelConfig model_;
  CacheConfig config_;
  int slots_ = 0;  // state slots allocated: the pool's and the extra sequences'
  KvEntryLayout kv_;
  IndexKeyLayout ix_;
  int64_t kv_page_bytes_ = 0, ix_page_bytes_ = 0;
  int64_t bytes_ = 0;
  cuda::DeviceBuffer<uint8_t> memory_;
  cuda::DeviceBuffer<int32_t> slot_scratch_;
  __nv_bfloat16* mtp_hidden_ = nullptr;  // [slots, hc, dim] in memory_; MTP models only
  std::vector<Stores> stores_;
};

}  // namespace dsv4
