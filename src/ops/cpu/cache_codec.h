// Encoding of KV entries and indexer keys into the cache byte layouts (cache_layout.h).
// Encoding is the reference's fake quantisation; decoding returns exactly the values the
// reference attends to.
#pragma once

#include <cstdint>

#include "kvcache/cache_layout.h"

namespace dsv4::cpu {

// kv: head_dim BF16 values (RoPE applied). NoPE -> e4m3 + UE8M0 per 64, RoPE -> BF16 bits.
void encode_kv_entry(const KvEntryLayout& l, const float* kv, uint8_t* data, uint8_t* scales);
void decode_kv_entry(const KvEntryLayout& l, const uint8_t* data, const uint8_t* scales, float* kv);

// key: index_dim BF16 values (Hadamard applied). -> e2m1 packed + UE8M0 per 32.
void encode_index_key(const IndexKeyLayout& l, const float* key, uint8_t* data, uint8_t* scales);
void decode_index_key(const IndexKeyLayout& l, const uint8_t* data, const uint8_t* scales,
                      float* key);

}  // namespace dsv4::cpu
