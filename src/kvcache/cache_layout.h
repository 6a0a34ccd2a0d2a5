// The byte layout of every cache store, shared by all backends so that cache contents can be
// compared byte for byte. Pure arithmetic on sizes and offsets; no allocation here.
//
// KV entries (sliding-window slots and compressed entries of every layer) use FlashMLA's
// "MODEL1" FP8 format: per entry `nope` e4m3 values ‖ `rope` BF16 values, and one UE8M0 scale
// per 64 NoPE values (+ padding). A page of `page_size` entries is split, not interleaved:
// [page_size x data_bytes][page_size x scale_bytes], padded to a multiple of data_bytes
// (the TMA-friendly layout FlashMLA and vLLM use). For DeepSeek-V4: 576 + 8 = 584 B/entry.
//
// Indexer keys use MXFP4: index_dim/2 bytes of packed e2m1 (element 2k in the low nibble) and
// one UE8M0 scale per 32 values; pages are split the same way, padded to data_bytes.
//
// Compressor states are fp32 [rows, width] arrays, kv rows then score rows, one per
// sequence: rows = coff*ratio, width = coff*d (coff = 2 for the overlapping ratio 4).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsv4 {

constexpr int64_t round_up(int64_t v, int64_t m) {
  return (v + m - 1) / m * m;
}

struct KvEntryLayout {
  int nope_dim = 448;
  int rope_dim = 64;
  static constexpr int kQuantBlock = 64;

  constexpr int num_scales() const { return nope_dim / kQuantBlock; }
  constexpr int data_bytes() const { return nope_dim + 2 * rope_dim; }
  constexpr int scale_bytes() const { return static_cast<int>(round_up(num_scales() + 1, 8)); }
  constexpr int entry_bytes() const { return data_bytes() + scale_bytes(); }
  constexpr int64_t page_bytes(int page_size) const {
    return round_up(int64_t(page_size) * entry_bytes(), data_bytes());
  }
  constexpr int64_t data_offset(int slot) const { return int64_t(slot) * data_bytes(); }
  constexpr int64_t scale_offset(int page_size, int slot) const {
    return int64_t(page_size) * data_bytes() + int64_t(slot) * scale_bytes();
  }
};

struct IndexKeyLayout {
  int dim = 128;
  static constexpr int kQuantBlock = 32;

  constexpr int num_scales() const { return dim / kQuantBlock; }
  constexpr int data_bytes() const { return dim / 2; }
  constexpr int scale_bytes() const { return num_scales(); }
  constexpr int entry_bytes() const { return data_bytes() + scale_bytes(); }
  constexpr int64_t page_bytes(int page_size) const {
    return round_up(int64_t(page_size) * entry_bytes(), data_bytes());
  }
  constexpr int64_t data_offset(int slot) const { return int64_t(slot) * data_bytes(); }
  constexpr int64_t scale_offset(int page_size, int slot) const {
    return int64_t(page_size) * data_bytes() + int64_t(slot) * scale_bytes();
  }
};

struct CompressorStateLayout {
  int ratio = 4;
  int dim = 512;  // head dim d of the compressor

  constexpr int coff() const { return ratio == 4 ? 2 : 1; }
  constexpr int rows() const { return coff() * ratio; }
  constexpr int width() const { return coff() * dim; }
  constexpr int64_t floats() const { return 2 * int64_t(rows()) * width(); }
  constexpr int64_t bytes() const { return floats() * 4; }
  // kv rows at float offset 0, score rows after them.
  constexpr int64_t kv_offset(int row) const { return int64_t(row) * width(); }
  constexpr int64_t score_offset(int row) const { return int64_t(rows() + row) * width(); }
};

}  // namespace dsv4
