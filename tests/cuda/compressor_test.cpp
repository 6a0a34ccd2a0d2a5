// The GPU compressors against the CPU ops (cpu::compressor_store / compressor_pool /
// compressor_finish + encode_kv_entry / encode_index_key), driven like CpuModel's
// run_compressor: per sequence, token by token, pooling at every block end. Checked after
// every call: the whole fp32 state pool bit for bit (including slots no sequence uses) and
// the whole paged store byte for byte (entries: >= 99.9 % identical, the rest one quantisation
// step; expected identical), for ratio 4 (main d 512, indexer d 128) and ratio 128, both
// kernel paths, sequences shorter than a block, blocks completing mid-chunk, chunked prefill
// with the state carried between calls, decode batches and mixed batches, pages crossed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "cuda/gpu_test.h"
#include "kvcache/cache_layout.h"
#include "ops/cpu/cache_codec.h"
#include "ops/cpu/compressor.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/common/device.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/compressor/compressor.h"
#include "support/rope_tables.h"

namespace dsv4 {
namespace {

using cuda::DeviceBuffer;
constexpr float kEps = 1e-6f;

class CudaCompressor : public test::GpuTest {};

struct Kind {
  int ratio, dim;
  bool indexer;
  int page_size;
  const char* name;
};
const Kind kKinds[] = {{4, 512, false, 16, "C4 main"},
                       {4, 128, true, 16, "C4 indexer"},
                       {128, 512, false, 2, "C128 main"}};
const cuda::CompressorPath kPaths[] = {cuda::CompressorPath::kFused, cuda::CompressorPath::kSplit,
                                       cuda::CompressorPath::kAuto};
const char* path_name(cuda::CompressorPath p) {
  return p == cuda::CompressorPath::kFused   ? "fused"
         : p == cuda::CompressorPath::kSplit ? "split"
                                             : "auto";
}

bool one_step(uint8_t a, uint8_t b, int mag_mask) {
  const int sign = mag_mask + 1;
  return (a & sign) == (b & sign) && std::abs(int(a & mag_mask) - int(b & mag_mask)) == 1;
}

// CPU and GPU copies of the states and the compressed store of `nseq` sequences.
struct Harness {
  Kind k;
  CompressorStateLayout l;
  cpu::CompressorWeights w;
  cpu::RopeTable rope = test::v4_yarn_table();
  int nseq = 0, slots = 0, stride = 0, data_bytes = 0, scale_bytes = 0;
  int64_t page_bytes = 0;
  std::vector<int32_t> table, slot_of;
  std::vector<int64_t> next_pos;
  std::vector<uint8_t> pages;
  std::vector<float> states;
  DeviceBuffer<uint8_t> d_pages;
  DeviceBuffer<float> d_states, d_ape, d_freq;
  DeviceBuffer<uint16_t> d_norm;
  DeviceBuffer<int32_t> d_table;

  Harness(const Kind& kind, int nseq_, int64_t max_tokens, std::mt19937& rng)
      : k(kind), nseq(nseq_) {
    l.ratio = k.ratio;
    l.dim = k.dim;
    w.ratio = k.ratio;
    w.dim = k.dim;
    w.rotate = k.indexer;
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    w.ape.resize(size_t(k.ratio) * l.width());
    for (auto& x : w.ape) x = u(rng);
    w.norm.resize(k.dim);
    for (auto& x : w.norm) x = round_bf16(1.0f + 0.5f * u(rng));
    data_bytes = k.indexer ? IndexKeyLayout{}.data_bytes() : KvEntryLayout{}.data_bytes();
    scale_bytes = k.indexer ? IndexKeyLayout{}.scale_bytes() : KvEntryLayout{}.scale_bytes();
    page_bytes = k.indexer ? IndexKeyLayout{}.page_bytes(k.page_size)
                           : KvEntryLayout{}.page_bytes(k.page_size);
    const int64_t entries = max_tokens / k.ratio + 1;
    stride = int((entries + k.page_size - 1) / k.page_size);
    const int npages = nseq * stride + 2;
    std::vector<int32_t> ids(npages);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ids.begin(), ids.begin() + nseq * stride);
    pages.assign(size_t(npages) * page_bytes, 0xCD);
    // Slots: permuted, two spare slots nobody may touch (poisoned).
    slots = nseq + 2;
    slot_of.resize(nseq);
    std::vector<int32_t> sl(slots);
    std::iota(sl.begin(), sl.end(), 0);
    std::shuffle(sl.begin(), sl.end(), rng);
    std::copy(sl.begin(), sl.begin() + nseq, slot_of.begin());
    states.assign(size_t(slots) * l.floats(), 7.25f);
    for (int s = 0; s < nseq; ++s) {
      float* st = &states[size_t(slot_of[s]) * l.floats()];
      std::fill(st, st + l.rows() * l.width(), 0.0f);  // kv = 0
      std::fill(st + l.rows() * l.width(), st + l.floats(),
                -std::numeric_limits<float>::infinity());
    }
    next_pos.assign(nseq, 0);
    d_ape = DeviceBuffer<float>(w.ape);
    d_freq = DeviceBuffer<float>(rope.inv_freq);
    std::vector<uint16_t> nb(k.dim);
    for (int i = 0; i < k.dim; ++i) nb[i] = float_to_bf16(w.norm[i]);
    d_norm = DeviceBuffer<uint16_t>(nb);
    d_table = DeviceBuffer<int32_t>(table);
    sync_to_gpu();
  }

  void sync_to_gpu() {
    d_pages = DeviceBuffer<uint8_t>(pages);
    d_states = DeviceBuffer<float>(states);
  }

  uint8_t* entry(int s, int64_t i, bool scales) {
    uint8_t* page = pages.data() + int64_t(table[s * stride + i / k.page_size]) * page_bytes;
    return scales ? page + int64_t(k.page_size) * data_bytes + (i % k.page_size) * scale_bytes
                  : page + (i % k.page_size) * data_bytes;
  }

  // The CPU model's run_compressor for one sequence's chunk.
  void cpu_chunk(int s, const float* a, const float* g, int n) {
    float* st = &states[size_t(slot_of[s]) * l.floats()];
    const int width = l.width();
    std::vector<float> pooled(k.dim), out(k.dim);
    for (int t = 0; t < n; ++t) {
      const int64_t p = next_pos[s] + t;
      cpu::compressor_store(w, l, st, p, a + size_t(t) * width, g + size_t(t) * width);
      if ((p + 1) % k.ratio != 0) continue;
      cpu::compressor_pool(w, l, st, pooled.data());
      cpu::compressor_finish(w, rope, kEps, p + 1 - k.ratio, pooled.data(), out.data());
      const int64_t i = (p + 1) / k.ratio - 1;
      if (k.indexer)
        cpu::encode_index_key(IndexKeyLayout{}, out.data(), entry(s, i, false), entry(s, i, true));
      else
        cpu::encode_kv_entry(KvEntryLayout{}, out.data(), entry(s, i, false), entry(s, i, true));
    }
  }

  // Random projections for a call with n[s] tokens per sequence (rows of a sequence together).
  void random_ag(std::mt19937& rng, int T, std::vector<float>& a, std::vector<float>& g) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int width = l.width();
    a.resize(size_t(T) * width);
    g.resize(size_t(T) * width);
    for (int t = 0; t < T; ++t) {
      const float sa = std::ldexp(1.0f, int(rng() % 5) - 2);
      for (int c = 0; c < width; ++c) {
        a[size_t(t) * width + c] = nd(rng) * sa;
        g[size_t(t) * width + c] = nd(rng) * 2.0f;
      }
    }
  }

  void cpu_only_step(const std::vector<int>& n, std::mt19937& rng) {
    const int T = std::accumulate(n.begin(), n.end(), 0);
    std::vector<float> a, g;
    random_ag(rng, T, a, g);
    int row = 0;
    for (int s = 0; s < nseq; ++s) {
      cpu_chunk(s, &a[size_t(row) * l.width()], &g[size_t(row) * l.width()], n[s]);
      row += n[s];
      next_pos[s] += n[s];
    }
  }

  // One call on both sides; returns false (after reporting) on a mismatch.
  // pdl: launched programmatically (CompressorParams::pdl; the same results).
  bool step(const std::vector<int>& n, cuda::CompressorPath path, std::mt19937& rng,
            const std::string& what, bool pdl = false) {
    const int T = std::accumulate(n.begin(), n.end(), 0);
    const int width = l.width();
    std::vector<float> a, g;
    random_ag(rng, T, a, g);
    // GPU: a and g as one [T, 2*width] buffer (a fused projection's output), strided views.
    std::vector<float> ag(size_t(std::max(T, 1)) * 2 * width);
    for (int t = 0; t < T; ++t) {
      std::copy_n(&a[size_t(t) * width], width, &ag[size_t(t) * 2 * width]);
      std::copy_n(&g[size_t(t) * width], width, &ag[size_t(t) * 2 * width + width]);
    }
    std::vector<int32_t> cu(nseq + 1, 0), start(nseq);
    int max_n = 0;
    for (int s = 0; s < nseq; ++s) {
      cu[s + 1] = cu[s] + n[s];
      start[s] = int32_t(next_pos[s]);
      max_n = std::max(max_n, n[s]);
    }
    DeviceBuffer<float> d_ag(ag);
    DeviceBuffer<int32_t> d_cu(cu), d_start(start), d_slot(slot_of);
    cuda::CompressorParams p;
    p.ratio = k.ratio;
    p.dim = k.dim;
    p.indexer = k.indexer;
    p.a = d_ag.data();
    p.g = d_ag.data() + width;
    p.a_stride = p.g_stride = 2 * width;
    p.ape = d_ape.data();
    p.norm_weight = reinterpret_cast<const __nv_bfloat16*>(d_norm.data());
    p.inv_freq = d_freq.data();
    p.eps = kEps;
    p.num_seqs = nseq;
    p.num_tokens = T;
    p.max_seq_tokens = max_n;
    p.cu_seqlens = d_cu.data();
    p.start_pos = d_start.data();
    p.state_slot = d_slot.data();
    p.states = d_states.data();
    p.store = k.indexer
                  ? cuda::index_store_view(d_pages.data(), k.page_size, d_table.data(), stride)
                  : cuda::kv_store_view(d_pages.data(), k.page_size, d_table.data(), stride);
    p.path = path;
    p.pdl = pdl;
    cuda::compressor_forward(p);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());

    int row = 0;
    for (int s = 0; s < nseq; ++s) {
      cpu_chunk(s, &a[size_t(row) * width], &g[size_t(row) * width], n[s]);
      row += n[s];
      next_pos[s] += n[s];
    }
    return compare_states(what) && compare_pages(what);
  }

  bool compare_states(const std::string& what) {
    const std::vector<float> got = d_states.download();
    for (size_t i = 0; i < states.size(); ++i) {
      if (std::memcmp(&got[i], &states[i], 4) == 0) continue;
      const int64_t slot = int64_t(i) / l.floats(), off = int64_t(i) % l.floats();
      const int64_t row = off / l.width(), col = off % l.width();
      int seq = -1;
      for (int s = 0; s < nseq; ++s)
        if (slot_of[s] == slot) seq = s;
      ADD_FAILURE() << what << ": state mismatch at slot " << slot << " (sequence " << seq
                    << (row < l.rows() ? ") kv row " : ") score row ") << row % l.rows() << " col "
                    << col << ": got " << got[i] << " want " << states[i];
      return false;
    }
    return true;
  }

  bool compare_pages(const std::string& what) {
    const std::vector<uint8_t> got = d_pages.download();
    int64_t differ = 0, bad = 0;
    std::string first;
    for (size_t i = 0; i < pages.size(); ++i) {
      if (got[i] == pages[i]) continue;
      ++differ;
      const int64_t o = int64_t(i) % page_bytes;
      bool ok = false;
      if (o < int64_t(k.page_size) * data_bytes) {
        const int64_t b = o % data_bytes;
        if (k.indexer) {
          ok = (got[i] & 0x0f) == (pages[i] & 0x0f) ? one_step(got[i] >> 4, pages[i] >> 4, 7)
               : (got[i] >> 4) == (pages[i] >> 4)   ? one_step(got[i] & 0xf, pages[i] & 0xf, 7)
                                                    : false;
        } else if (b < 448) {
          ok = one_step(got[i], pages[i], 0x7f);
        } else {
          const size_t lo = i & ~size_t(1);
          const int x = got[lo] | (got[lo + 1] << 8), y = pages[lo] | (pages[lo + 1] << 8);
          ok = (x & 0x8000) == (y & 0x8000) && std::abs((x & 0x7fff) - (y & 0x7fff)) <= 1;
        }
      }
      if (!ok && bad++ == 0) {
        const int64_t page = int64_t(i) / page_bytes;
        first = cat("page ", page, " byte ", o,
                    (o < int64_t(k.page_size) * data_bytes ? " (data" : " (scales/pad"),
                    ", entry slot ",
                    (o < int64_t(k.page_size) * data_bytes
                         ? o / data_bytes
                         : (o - int64_t(k.page_size) * data_bytes) / scale_bytes),
                    "): got ", int(got[i]), " want ", int(pages[i]));
      }
    }
    if (differ)
      std::printf("[ note ] %s: %lld store bytes differ (all within one step: %s)\n", what.c_str(),
                  (long long)differ, bad ? "no" : "yes");
    EXPECT_EQ(bad, 0) << what << ": " << bad
                      << " store bytes differ by more than one step; first: " << first;
    EXPECT_LE(differ * 1000, int64_t(pages.size())) << what;
    return bad == 0;
  }
};

std::string label(const Kind& k, cuda::CompressorPath p, const std::string& s) {
  return cat(k.name, " / ", path_name(p), " / ", s);
}

TEST_F(CudaCompressor, SmokeOneBlock) {
  std::mt19937 rng(1);
  for (const Kind& k : kKinds) {
    Harness h(k, 1, 256, rng);
    EXPECT_TRUE(h.step({k.ratio + 1}, cuda::CompressorPath::kAuto, rng,
                       label(k, cuda::CompressorPath::kAuto, "smoke")));
  }
}

// One sequence from position 0, one call: shorter than a block, exactly a block, blocks
// completing inside the chunk.
TEST_F(CudaCompressor, PrefillFromZero) {
  std::mt19937 rng(2);
  for (const Kind& k : kKinds) {
    const std::vector<int> lens = k.ratio == 4 ? std::vector<int>{1, 3, 4, 5, 9, 131, 301}
                                               : std::vector<int>{1, 100, 128, 129, 300, 600};
    for (auto path : kPaths)
      for (int n : lens) {
        Harness h(k, 1, n, rng);
        if (!h.step({n}, path, rng, label(k, path, cat("prefill ", n)))) return;
      }
  }
}

// One sequence in chunks; blocks straddle chunk boundaries, the state is carried between calls.
TEST_F(CudaCompressor, ChunkedPrefillCarriesState) {
  std::mt19937 rng(3);
  for (const Kind& k : kKinds) {
    const std::vector<int> chunks = k.ratio == 4
                                        ? std::vector<int>{2, 5, 1, 4, 13, 3, 64, 1, 2}
                                        : std::vector<int>{100, 60, 200, 1, 127, 1, 129, 3};
    const int total = std::accumulate(chunks.begin(), chunks.end(), 0);
    for (auto path : kPaths) {
      Harness h(k, 1, total, rng);
      for (size_t c = 0; c < chunks.size(); ++c)
        if (!h.step({chunks[c]}, path, rng,
                    label(k, path, cat("chunk ", c, " (", chunks[c], " tokens)"))))
          return;
    }
  }
}

// Many sequences at different positions (state and entries prefilled by the CPU), 1-4 tokens
// each per call (some none), several calls.
TEST_F(CudaCompressor, DecodeBatches) {
  std::mt19937 rng(4);
  const int nseq = 37;
  for (const Kind& k : kKinds) {
    for (auto path : kPaths) {
      const int prefill_max = k.ratio == 4 ? 40 : 300;
      Harness h(k, nseq, prefill_max + 6 * 4, rng);
      std::vector<int> pre(nseq);
      for (auto& x : pre) x = int(rng() % (prefill_max + 1));
      h.cpu_only_step(pre, rng);
      h.sync_to_gpu();
      for (int step = 0; step < 6; ++step) {
        std::vector<int> n(nseq);
        for (auto& x : n) x = int(rng() % 5);  // 0..4
        // Every other step launched programmatically (the engine's decode launch).
        if (!h.step(n, path, rng, label(k, path, cat("decode step ", step)), step % 2 == 1)) return;
      }
    }
  }
}

// Prefill and decode sequences in one call.
TEST_F(CudaCompressor, MixedBatches) {
  std::mt19937 rng(5);
  for (const Kind& k : kKinds) {
    for (auto path : kPaths) {
      const std::vector<int> n1 = {1, 2, 300, 4, 0, 129, 5};
      const std::vector<int> n2 = {3, 130, 1, 0, 7, 2, 256};
      Harness h(k, int(n1.size()), 1000, rng);
      std::vector<int> pre(n1.size());
      for (auto& x : pre) x = int(rng() % 200);
      h.cpu_only_step(pre, rng);
      h.sync_to_gpu();
      if (!h.step(n1, path, rng, label(k, path, "mixed 1"))) return;
      if (!h.step(n2, path, rng, label(k, path, "mixed 2"))) return;
    }
  }
}

TEST_F(CudaCompressor, ResetStates) {
  for (const Kind& k : kKinds) {
    CompressorStateLayout l;
    l.ratio = k.ratio;
    l.dim = k.dim;
    const int slots = 5;
    DeviceBuffer<float> st(size_t(slots) * l.floats());
    st.fill_bytes(0x40);  // 3.0039 everywhere
    const std::vector<int32_t> which = {3, 0};
    DeviceBuffer<int32_t> d_which(which);
    cuda::compressor_reset_states(st.data(), d_which.data(), 2, k.ratio, k.dim);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = st.download();
    float poison;
    std::memset(&poison, 0x40, 4);
    for (int s = 0; s < slots; ++s)
      for (int64_t i = 0; i < l.floats(); ++i) {
        const bool reset = s == 3 || s == 0;
        const float want = !reset                  ? poison
                           : i < l.score_offset(0) ? 0.0f
                                                   : -std::numeric_limits<float>::infinity();
        ASSERT_EQ(got[size_t(s) * l.floats() + i], want)
            << k.name << " slot " << s << " float " << i;
      }
  }
}

TEST_F(CudaCompressor, RejectsUnsupported) {
  cuda::CompressorParams p;
  p.ratio = 128;
  p.dim = 128;
  p.indexer = true;
  p.num_seqs = 1;
  EXPECT_THROW(cuda::compressor_forward(p), Error);
  p.ratio = 8;
  p.dim = 512;
  p.indexer = false;
  EXPECT_THROW(cuda::compressor_forward(p), Error);
  p.ratio = 4;
  EXPECT_THROW(cuda::compressor_forward(p), Error);  // no batch arrays
  p.num_seqs = 0;
  EXPECT_NO_THROW(cuda::compressor_forward(p));  // nothing to do
}

}  // namespace
}  // namespace dsv4
