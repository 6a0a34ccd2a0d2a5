// Compressors (ratio 4 main d 512, ratio 4 indexer d 128, ratio 128 main d 512) — the same
// kernels for V4-Flash and V4-Pro (the compressor's shapes do not depend on the model width;
// a = wkv(x), g = wgate(x) are inputs). Decode: b = 1..256 sequences, s_q 1 and 2, at context
// 16K, with positions either spread (a quarter of C4 sequences complete a block per token) or
// aligned so every sequence completes a block in the call (the worst step). Prefill: 4K / 8K
// tokens of one sequence starting at 0 and at 16K, fused and split paths. Bytes = what the op
// must move: a/g rows read, state rows read for pooling and written back, entries written.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/bench_util.h"
#include "kvcache/cache_layout.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/compressor/compressor.h"

using namespace dsv4;
using cuda::DeviceBuffer;

namespace {

struct Kind {
  int ratio, dim;
  bool indexer;
  const char* name;
};

std::vector<float> random_f32(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// `aligned`: every sequence's chunk ends on a block boundary.
void run(const Kind& k, int seqs, int per_seq, int64_t p0, bool aligned, cuda::CompressorPath path,
         const std::string& label) {
  CompressorStateLayout l;
  l.ratio = k.ratio;
  l.dim = k.dim;
  const int T = seqs * per_seq, width = l.width();
  std::vector<int32_t> cu(seqs + 1), start(seqs), slot(seqs);
  std::mt19937 rng(7);
  for (int s = 0; s < seqs; ++s) {
    cu[s + 1] = cu[s] + per_seq;
    // aligned: the chunk ends on a block boundary ((p + per_seq) % ratio == 0).
    const int64_t p = aligned ? p0 - (p0 + per_seq) % k.ratio : p0 + int64_t(rng() % k.ratio);
    start[s] = int32_t(p);
    slot[s] = s;
  }
  // Store: enough pages of 64 entries for every sequence up to its last position.
  const int page_size = 64;
  const int64_t max_entries = (p0 + per_seq + k.ratio) / k.ratio + 1;
  const int stride = int((max_entries + page_size - 1) / page_size);
  const int64_t page_bytes =
      k.indexer ? IndexKeyLayout{}.page_bytes(page_size) : KvEntryLayout{}.page_bytes(page_size);
  std::vector<int32_t> table(size_t(seqs) * stride);
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
  const size_t ag_floats = size_t(T) * 2 * width;
  const int copies = bench::rotation_copies(ag_floats * 4 + size_t(seqs) * l.bytes());
  std::vector<DeviceBuffer<float>> ag, states;
  for (int c = 0; c < copies; ++c) {
    ag.emplace_back(random_f32(ag_floats, 100 + c));
    std::vector<float> st(size_t(seqs) * l.floats());
    for (int s = 0; s < seqs; ++s)
      for (int64_t i = 0; i < l.floats(); ++i)
        st[size_t(s) * l.floats() + i] = i < l.rows() * l.width() ? 0.5f : -1.0f;
    states.emplace_back(st);
  }
  DeviceBuffer<uint8_t> pages(table.size() * page_bytes);
  DeviceBuffer<int32_t> d_cu(cu), d_start(start), d_slot(slot), d_table(table);
  DeviceBuffer<float> ape(random_f32(size_t(k.ratio) * width, 3)),
      freq(std::vector<float>(32, 0.01f));
  DeviceBuffer<uint16_t> norm(std::vector<uint16_t>(k.dim, 0x3f80));
  const double us = bench::median_us([&](int i) {
    cuda::CompressorParams p;
    p.ratio = k.ratio;
    p.dim = k.dim;
    p.indexer = k.indexer;
    p.a = ag[i % copies].data();
    p.g = ag[i % copies].data() + width;
    p.a_stride = p.g_stride = 2 * width;
    p.ape = ape.data();
    p.norm_weight = reinterpret_cast<const __nv_bfloat16*>(norm.data());
    p.inv_freq = freq.data();
    p.num_seqs = seqs;
    p.num_tokens = T;
    p.max_seq_tokens = per_seq;
    p.cu_seqlens = d_cu.data();
    p.start_pos = d_start.data();
    p.state_slot = d_slot.data();
    p.states = states[i % copies].data();
    p.store = k.indexer ? cuda::index_store_view(pages.data(), page_size, d_table.data(), stride)
                        : cuda::kv_store_view(pages.data(), page_size, d_table.data(), stride);
    p.path = path;
    cuda::compressor_forward(p);
  });
  // Bytes: a/g of every token; per completed block the pooled rows that come from the state
  // (read) and the entry (written); the state rows written back.
  double bytes = double(ag_floats) * 4;
  const int entry = k.indexer ? 68 : 584;
  for (int s = 0; s < seqs; ++s) {
    const int64_t a = start[s], e = a + per_seq;
    const int64_t blocks = e / k.ratio - a / k.ratio;
    const int64_t rows_from_state = std::max<int64_t>(0, l.rows() - per_seq);
    bytes += double(blocks) * entry + (blocks ? double(rows_from_state) * k.dim * 2 * 4 : 0.0);
    bytes += double(std::min<int64_t>(per_seq, l.rows())) * width * 2 * 4;
  }
  bench::Result r;
  r.kernel = std::string("compressor ") + k.name +
             (path == cuda::CompressorPath::kFused   ? " fused"
              : path == cuda::CompressorPath::kSplit ? " split"
                                                     : " auto");
  r.shape = label;
  r.us = us;
  r.bytes = bytes;
  r.peer = "none (HBM roofline)";
  r.emit();
}

}  // namespace

int main() {
  const Kind kinds[] = {
      {4, 512, false, "C4-main"}, {4, 128, true, "C4-indexer"}, {128, 512, false, "C128-main"}};
  for (const Kind& k : kinds) {
    for (int b : {1, 2, 32, 64, 128, 256})
      for (int sq : {1, 2})
        for (bool aligned : {false, true})
          run(k, b, sq, 16384, aligned, cuda::CompressorPath::kAuto,
              "decode b" + std::to_string(b) + " s_q" + std::to_string(sq) + " ctx16K" +
                  (aligned ? " all-complete" : " spread"));
    for (int n : {4096, 8192})
      for (int64_t p0 : {int64_t(0), int64_t(16384)})
        for (auto path : {cuda::CompressorPath::kSplit, cuda::CompressorPath::kFused})
          run(k, 1, n, p0, false, path,
              "prefill " + std::to_string(n) + " from " + std::to_string(p0));
    // Several prefill sequences at once (bandwidth at >= 32 MB).
    run(k, 8, 4096, 0, false, cuda::CompressorPath::kSplit, "prefill 8x4096");
  }
  return 0;
}
