// A model's cache in the shared layout (kvcache/): which stores its sequences keep, the byte
// layouts of their entries, and the bytes a pool of a given configuration takes in every
// backend (the CPU's host cache and the GPU's device cache hold the same stores, store by
// store, each aligned to 256 bytes).
#pragma once

#include <cstdint>

#include "kvcache/block_manager.h"
#include "kvcache/cache_layout.h"
#include "model/model_config.h"

namespace dsv4 {

CacheSpec cache_spec(const ModelConfig& c);
KvEntryLayout kv_layout(const ModelConfig& c);
IndexKeyLayout index_layout(const ModelConfig& c);
// The compressor state of block b's main compressor (ratio > 0) and of the indexer's.
CompressorStateLayout main_state_layout(const ModelConfig& c, int block);
CompressorStateLayout index_state_layout(const ModelConfig& c);
// The compressed pages' kind of a block with ratio > 0.
PageKind compressed_kind(const ModelConfig& c, int block);

// Enough pages for `max_seqs` sequences of up to `max_tokens` tokens each.
inline CacheConfig cache_capacity(const ModelConfig& c, int max_seqs, int64_t max_tokens,
                                  int page_size) {
  return CacheConfig::for_capacity(cache_spec(c), max_seqs, max_tokens, page_size);
}

// Bytes of one block's stores (0 where the block has none).
struct CacheStoreBytes {
  int64_t window = 0, compressed = 0, index_keys = 0, main_state = 0, index_state = 0;
};
CacheStoreBytes cache_store_bytes(const ModelConfig& m, const CacheConfig& c, int block);
// A store's allocation: at least one aligned chunk where the block has the store, so kernels
// that validate their store pointers see a real (never read) address.
int64_t cache_alloc_bytes(int64_t bytes, bool exists);
constexpr int64_t kCacheStoreAlign = 256;
// The whole pool's bytes.
int64_t cache_bytes(const ModelConfig& m, const CacheConfig& c);

// The part of every pool that does not depend on the context: the window rings and
// compressor states of `max_seqs` sequences and `extra_slots` more (plan_cache's) without
// compressed pages. Its bytes are the least such a pool takes.
CacheConfig cache_fixed_part(const ModelConfig& c, int max_seqs, int page_size,
                             int extra_slots = 0);

// The pool for `max_seqs` sequences of up to `max_context` tokens (`budget_bytes` <= 0), or
// one of at most `budget_bytes` (window pages and state slots for max_seqs sequences, the rest
// shared by the C4 and C128 stores in the model's per-token proportion). `extra_slots` more
// state slots and window rings (prefix-cache snapshots, whose compressed pages are shared
// with the requests) get no compressed pages of their own. Throws when the window rings and
// states alone do not fit.
CacheConfig plan_cache(const ModelConfig& c, int max_seqs, int64_t max_context, int page_size,
                       int64_t budget_bytes, int extra_slots = 0);

}  // namespace dsv4
