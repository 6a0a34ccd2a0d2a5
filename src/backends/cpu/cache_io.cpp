#include "backends/cpu/cache_io.h"

#include <cstring>

#include "core/error.h"
#include "ops/cpu/cache_codec.h"

namespace dsv4 {
namespace {

// Encodes `v` into `r` and checks the entry decodes to exactly `v`.
template <typename Layout, typename Enc, typename Dec>
void put_exact(const Layout& l, int width, EntryRef r, const float* v, Enc enc, Dec dec,
               const char* what, int64_t index) {
  enc(l, v, r.data, r.scales);
  std::vector<float> back(width);
  dec(l, r.data, r.scales, back.data());
  for (int i = 0; i < width; ++i)
    DSV4_CHECK(back[i] == v[i] || (back[i] != back[i] && v[i] != v[i]), what, " entry ", index,
               " element ", i, ": value ", v[i], " is not representable in the cache format (got ",
               back[i], ")");
}

}  // namespace

std::vector<float> read_window(HostCache& c, int block, const SequenceCache& s) {
  const KvEntryLayout& l = c.kv_layout();
  const int D = l.nope_dim + l.rope_dim;
  // Slot j holds the latest position congruent to j modulo the window.
  const int64_t window = c.main_window();
  std::vector<float> v(size_t(window) * D);
  for (int64_t j = 0; j < window; ++j) {
    EntryRef r = c.window_slot(block, s, j);
    cpu::decode_kv_entry(l, r.data, r.scales, v.data() + size_t(j) * D);
  }
  return v;
}

std::vector<float> read_compressed(HostCache& c, int block, const SequenceCache& s, int64_t count) {
  const KvEntryLayout& l = c.kv_layout();
  const int D = l.nope_dim + l.rope_dim;
  std::vector<float> v(size_t(count) * D);
  for (int64_t i = 0; i < count; ++i) {
    EntryRef r = c.compressed(block, s, i);
    cpu::decode_kv_entry(l, r.data, r.scales, v.data() + size_t(i) * D);
  }
  return v;
}

std::vector<float> read_index_keys(HostCache& c, int block, const SequenceCache& s, int64_t count) {
  const IndexKeyLayout& l = c.index_layout();
  std::vector<float> v(size_t(count) * l.dim);
  for (int64_t i = 0; i < count; ++i) {
    EntryRef r = c.index_key(block, s, i);
    cpu::decode_index_key(l, r.data, r.scales, v.data() + size_t(i) * l.dim);
  }
  return v;
}

void write_window(HostCache& c, int block, const SequenceCache& s, const float* values) {
  const KvEntryLayout& l = c.kv_layout();
  const int D = l.nope_dim + l.rope_dim;
  for (int64_t j = 0; j < c.main_window(); ++j)
    put_exact(l, D, c.window_slot(block, s, j), values + size_t(j) * D, cpu::encode_kv_entry,
              cpu::decode_kv_entry, "window", j);
}

void write_compressed(HostCache& c, int block, const SequenceCache& s, const float* values,
                      int64_t count) {
  const KvEntryLayout& l = c.kv_layout();
  const int D = l.nope_dim + l.rope_dim;
  for (int64_t i = 0; i < count; ++i)
    put_exact(l, D, c.compressed(block, s, i), values + size_t(i) * D, cpu::encode_kv_entry,
              cpu::decode_kv_entry, "compressed", i);
}

void write_index_keys(HostCache& c, int block, const SequenceCache& s, const float* values,
                      int64_t count) {
  const IndexKeyLayout& l = c.index_layout();
  for (int64_t i = 0; i < count; ++i)
    put_exact(l, l.dim, c.index_key(block, s, i), values + size_t(i) * l.dim, cpu::encode_index_key,
              cpu::decode_index_key, "indexer key", i);
}

}  // namespace dsv4
