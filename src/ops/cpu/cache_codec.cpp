#include "ops/cpu/cache_codec.h"

#include <cstring>

#include "core/formats.h"
#include "ops/cpu/quant.h"

namespace dsv4::cpu {

void encode_kv_entry(const KvEntryLayout& l, const float* kv, uint8_t* data, uint8_t* scales) {
  quantize_fp8(kv, l.nope_dim, KvEntryLayout::kQuantBlock, data, scales);
  std::memset(scales + l.num_scales(), 0, l.scale_bytes() - l.num_scales());
  for (int i = 0; i < l.rope_dim; ++i) {
    const bf16_t b = float_to_bf16(kv[l.nope_dim + i]);
    std::memcpy(data + l.nope_dim + 2 * i, &b, 2);
  }
}

void decode_kv_entry(const KvEntryLayout& l, const uint8_t* data, const uint8_t* scales,
                     float* kv) {
  for (int b = 0; b < l.num_scales(); ++b) {
    const float s = e8m0_to_float(scales[b]);
    for (int i = b * KvEntryLayout::kQuantBlock; i < (b + 1) * KvEntryLayout::kQuantBlock; ++i)
      kv[i] = e4m3_to_float(data[i]) * s;
  }
  for (int i = 0; i < l.rope_dim; ++i) {
    bf16_t b;
    std::memcpy(&b, data + l.nope_dim + 2 * i, 2);
    kv[l.nope_dim + i] = bf16_to_float(b);
  }
}

void encode_index_key(const IndexKeyLayout& l, const float* key, uint8_t* data, uint8_t* scales) {
  quantize_fp4(key, l.dim, IndexKeyLayout::kQuantBlock, data, scales);
}

void decode_index_key(const IndexKeyLayout& l, const uint8_t* data, const uint8_t* scales,
                      float* key) {
  for (int i = 0; i < l.dim; i += 2) {
    const float s = e8m0_to_float(scales[i / IndexKeyLayout::kQuantBlock]);
    key[i] = e2m1_to_float(e2m1_low(data[i / 2])) * s;
    key[i + 1] = e2m1_to_float(e2m1_high(data[i / 2])) * s;
  }
}

}  // namespace dsv4::cpu
