// The CUDA lightning indexer against the CPU ops (cpu::hadamard_rotate, fake_quant_fp4,
// indexer_scores, topk_desc) on fresh random inputs, outputs poisoned before every launch.
// Skipped without a GPU, saying so.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/formats.h"
#include "cuda/gpu_test.h"
#include "kvcache/cache_layout.h"
#include "ops/cpu/cache_codec.h"
#include "ops/cpu/hadamard.h"
#include "ops/cpu/indexer.h"
#include "ops/cpu/quant.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/common/device.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/indexer/indexer.h"
#include "support/bf16_vectors.h"
#include "support/rope_tables.h"

namespace dsv4 {
namespace {

using cuda::DeviceBuffer;
using test::to_bf16_bits;
using test::v4_yarn_table;

constexpr int kDim = 128, kRope = 64;

class CudaIndexer : public test::GpuTest {};

// A batch: sequences with token counts and first positions.
struct Batch {
  std::vector<int> ntok, pos0;
  std::vector<int32_t> cu;
  int tokens() const { return cu.back(); }
  int64_t max_pos() const {
    int64_t m = 0;
    for (size_t s = 0; s < ntok.size(); ++s) m = std::max<int64_t>(m, pos0[s] + ntok[s] - 1);
    return m;
  }
  int max_tokens() const { return *std::max_element(ntok.begin(), ntok.end()); }
  int seq_of(int t) const {
    int s = 0;
    while (cu[s + 1] <= t) ++s;
    return s;
  }
  int pos_of(int t) const {
    const int s = seq_of(t);
    return pos0[s] + (t - cu[s]);
  }
};

Batch make_batch(std::vector<int> ntok, std::vector<int> pos0) {
  Batch b{std::move(ntok), std::move(pos0), {0}};
  for (int n : b.ntok) b.cu.push_back(b.cu.back() + n);
  return b;
}

// Paged MXFP4 key store of `nkeys[s]` random keys per sequence (pages shuffled over the pool,
// unused table entries -1), with the decoded values the CPU attends to.
struct KeyStore {
  IndexKeyLayout layout;
  int page_size = 0, stride = 0;
  std::vector<uint8_t> pages;
  std::vector<int32_t> table;
  std::vector<std::vector<float>> decoded;  // [s][i * 128 + d]
};

KeyStore make_keys(const std::vector<int64_t>& nkeys, int page_size, std::mt19937& rng) {
  KeyStore ks;
  ks.page_size = page_size;
  const int64_t pb = ks.layout.page_bytes(page_size);
  int total_pages = 0;
  for (int64_t n : nkeys) {
    const int np = int((n + page_size - 1) / page_size);
    ks.stride = std::max(ks.stride, np);
    total_pages += np;
  }
  ks.stride = std::max(ks.stride, 1);
  std::vector<int32_t> ids(total_pages + 3);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  ks.pages.assign(size_t(ids.size()) * pb, 0xA5);  // unused bytes hold garbage
  ks.table.assign(nkeys.size() * ks.stride, -1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-3.0f, 3.0f);
  int next = 0;
  std::vector<float> key(kDim);
  for (size_t s = 0; s < nkeys.size(); ++s) {
    ks.decoded.emplace_back(size_t(nkeys[s]) * kDim);
    for (int64_t i = 0; i < nkeys[s]; ++i) {
      if (i % page_size == 0) ks.table[s * ks.stride + i / page_size] = ids[next++];
      const float sc = std::pow(2.0f, mag(rng));
      for (float& v : key) v = round_bf16(nd(rng) * sc);
      uint8_t* page = ks.pages.data() + size_t(ks.table[s * ks.stride + i / page_size]) * pb;
      const int slot = int(i % page_size);
      uint8_t* data = page + ks.layout.data_offset(slot);
      uint8_t* scales = page + ks.layout.scale_offset(page_size, slot);
      cpu::encode_index_key(ks.layout, key.data(), data, scales);
      cpu::decode_index_key(ks.layout, data, scales, ks.decoded[s].data() + size_t(i) * kDim);
    }
  }
  return ks;
}

// Device copies of a batch, a key store and the indexer inputs; fills IndexerParams.
struct Fixture {
  Batch batch;
  KeyStore keys;
  int heads = 0, topk = 0;
  std::vector<uint16_t> q, wproj;  // BF16 bits
  DeviceBuffer<int32_t> d_cu, d_pos0, d_table;
  DeviceBuffer<uint8_t> d_pages;
  DeviceBuffer<uint16_t> d_q, d_wproj, d_qfp4, d_w, d_scores;
  DeviceBuffer<float> d_inv_freq;
  DeviceBuffer<int32_t> d_topk;
  cuda::IndexerParams p;
  int64_t stride = 0;

  Fixture(Batch b, int h, int k, int page_size, std::mt19937& rng)
      : batch(std::move(b)), heads(h), topk(k) {
    std::vector<int64_t> nkeys;
    for (size_t s = 0; s < batch.ntok.size(); ++s)
      nkeys.push_back((int64_t(batch.pos0[s]) + batch.ntok[s]) / 4);
    keys = make_keys(nkeys, page_size, rng);
    const int T = batch.tokens();
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> qf(size_t(T) * h * kDim), wf(size_t(T) * h);
    for (float& v : qf) v = nd(rng);
    for (float& v : wf) v = nd(rng);
    q = to_bf16_bits(qf);
    wproj = to_bf16_bits(wf);
    stride = std::max<int64_t>(1, (batch.max_pos() + 1) / 4) + 5;  // odd padding on purpose
    d_cu = DeviceBuffer<int32_t>(batch.cu);
    d_pos0 = DeviceBuffer<int32_t>(std::vector<int32_t>(batch.pos0.begin(), batch.pos0.end()));
    d_table = DeviceBuffer<int32_t>(keys.table);
    d_pages = DeviceBuffer<uint8_t>(keys.pages);
    d_q = DeviceBuffer<uint16_t>(q);
    d_wproj = DeviceBuffer<uint16_t>(wproj);
    d_qfp4 = DeviceBuffer<uint16_t>(q.size());
    d_w = DeviceBuffer<uint16_t>(wproj.size());
    d_scores = DeviceBuffer<uint16_t>(size_t(T) * stride);
    d_inv_freq = DeviceBuffer<float>(v4_yarn_table().inv_freq);
    d_topk = DeviceBuffer<int32_t>(size_t(T) * k);
    p.batch = {d_cu.data(), d_pos0.data(),      int(batch.ntok.size()),
               T,           batch.max_tokens(), batch.max_pos()};
    p.n_heads = h;
    p.topk = k;
    p.q = reinterpret_cast<const __nv_bfloat16*>(d_q.data());
    p.wproj = reinterpret_cast<const __nv_bfloat16*>(d_wproj.data());
    p.inv_freq = d_inv_freq.data();
    p.keys = cuda::index_store_view(d_pages.data(), page_size, d_table.data(), keys.stride);
    p.q_fp4 = reinterpret_cast<__nv_bfloat16*>(d_qfp4.data());
    p.weights = reinterpret_cast<__nv_bfloat16*>(d_w.data());
    p.scores = reinterpret_cast<__nv_bfloat16*>(d_scores.data());
    p.score_stride = stride;
    p.topk_idx = d_topk.data();
    d_qfp4.fill_bytes(0xff);
    d_w.fill_bytes(0xff);
    d_scores.fill_bytes(0xff);
    d_topk.fill_bytes(0x7f);
  }
};

// CPU query path of token t, head h (CpuModel::attention's order of operations).
void cpu_query(const Fixture& f, const cpu::RopeTable& rope, int t, int h, float* v) {
  for (int d = 0; d < kDim; ++d) v[d] = bf16_to_float(f.q[(size_t(t) * f.heads + h) * kDim + d]);
  std::vector<float> c(kRope / 2), s(kRope / 2);
  rope.cos_sin(f.batch.pos_of(t), c.data(), s.data());
  cpu::rope_apply(v + kDim - kRope, kRope, c.data(), s.data(), false);
  cpu::hadamard_rotate(v, kDim);
  cpu::fake_quant_fp4(v, kDim, IndexKeyLayout::kQuantBlock, v);
}
float cpu_weight(const Fixture& f, int t, int h) {
  const float wscale =
      static_cast<float>(1.0 / std::sqrt(double(kDim)) / std::sqrt(double(f.heads)));
  return round_bf16(bf16_to_float(f.wproj[size_t(t) * f.heads + h]) * wscale);
}

std::string describe(const Batch& b) {
  std::ostringstream os;
  for (size_t s = 0; s < b.ntok.size(); ++s) os << "[" << b.ntok[s] << "@" << b.pos0[s] << "]";
  return os.str();
}

// Checks q_fp4 and weights bit for bit.
void check_query(const Fixture& f) {
  const auto rope = v4_yarn_table();
  const auto q = f.d_qfp4.download();
  const auto w = f.d_w.download();
  std::vector<float> v(kDim);
  int64_t bad = 0;
  for (int t = 0; t < f.batch.tokens(); ++t)
    for (int h = 0; h < f.heads; ++h) {
      cpu_query(f, rope, t, h, v.data());
      for (int d = 0; d < kDim; ++d) {
        const uint16_t want = float_to_bf16(v[d]), got = q[(size_t(t) * f.heads + h) * kDim + d];
        if (want != got && bad++ < 5)
          ADD_FAILURE() << "q_fp4 token " << t << " (pos " << f.batch.pos_of(t) << ") head " << h
                        << " dim " << d << ": gpu " << bf16_to_float(got) << " (0x" << std::hex
                        << got << ") cpu " << v[d] << " (0x" << want << std::dec << ")";
      }
      const uint16_t ww = float_to_bf16(cpu_weight(f, t, h)), gw = w[size_t(t) * f.heads + h];
      if (ww != gw && bad++ < 5)
        ADD_FAILURE() << "weight token " << t << " head " << h << ": gpu " << bf16_to_float(gw)
                      << " cpu " << bf16_to_float(ww);
    }
  EXPECT_EQ(bad, 0) << "mismatching q_fp4/weight values, batch " << describe(f.batch);
}

// Scores vs cpu::indexer_scores on the GPU's own q_fp4 / weights (identical inputs): bit for
// bit on every visible entry; entries past the visible count keep the poison.
void check_scores(const Fixture& f) {
  const auto q = f.d_qfp4.download();
  const auto w = f.d_w.download();
  const auto sc = f.d_scores.download();
  std::vector<float> qf(size_t(f.heads) * kDim), wf(f.heads), cpu(f.stride);
  int64_t bad = 0, checked = 0;
  for (int t = 0; t < f.batch.tokens(); ++t) {
    const int s = f.batch.seq_of(t);
    const int nvis = (f.batch.pos_of(t) + 1) / 4;
    for (int i = 0; i < f.heads * kDim; ++i)
      qf[i] = bf16_to_float(q[size_t(t) * f.heads * kDim + i]);
    for (int h = 0; h < f.heads; ++h) wf[h] = bf16_to_float(w[size_t(t) * f.heads + h]);
    cpu::indexer_scores(qf.data(), wf.data(), f.heads, kDim, f.keys.decoded[s].data(), nvis,
                        cpu.data());
    for (int64_t i = 0; i < f.stride; ++i) {
      const uint16_t got = sc[size_t(t) * f.stride + i];
      if (i < nvis) {
        ++checked;
        const uint16_t want = float_to_bf16(cpu[i]);
        if (want != got && bad++ < 5)
          ADD_FAILURE() << "score token " << t << " (seq " << s << ", pos " << f.batch.pos_of(t)
                        << ") entry " << i << ": gpu " << bf16_to_float(got) << " cpu " << cpu[i];
      } else if (got != 0xffff && bad++ < 5) {
        ADD_FAILURE() << "score token " << t << " entry " << i << " >= visible " << nvis
                      << " was written (" << bf16_to_float(got) << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0) << "of " << checked << " scores, batch " << describe(f.batch) << ", heads "
                    << f.heads;
}

// Top-k vs cpu::topk_desc on the GPU's scores: identical indices in identical order, -1 after.
void check_topk(const Fixture& f) {
  const auto sc = f.d_scores.download();
  const auto idx = f.d_topk.download();
  std::vector<float> row(f.stride);
  std::vector<int32_t> want(f.topk);
  int64_t bad = 0;
  for (int t = 0; t < f.batch.tokens(); ++t) {
    const int nvis = (f.batch.pos_of(t) + 1) / 4;
    for (int i = 0; i < nvis; ++i) row[i] = bf16_to_float(sc[size_t(t) * f.stride + i]);
    const int kk = cpu::topk_desc(row.data(), nvis, f.topk, want.data());
    for (int r = 0; r < f.topk; ++r) {
      const int32_t g = idx[size_t(t) * f.topk + r], c = r < kk ? want[r] : -1;
      if (g != c && bad++ < 5)
        ADD_FAILURE() << "top-k token " << t << " (visible " << nvis << ", k " << f.topk
                      << ") rank " << r << ": gpu " << g << " (score "
                      << (g >= 0 && g < nvis ? row[g] : NAN) << ") cpu " << c << " (score "
                      << (c >= 0 ? row[c] : NAN) << ")";
    }
  }
  EXPECT_EQ(bad, 0) << "mismatching top-k slots, batch " << describe(f.batch) << ", k " << f.topk;
}

const char* logits_path_name(cuda::IndexerLogitsPath path) {
  switch (path) {
    case cuda::IndexerLogitsPath::kMma:
      return "mma";
    case cuda::IndexerLogitsPath::kWgmma:
      return "wgmma";
    default:
      return "auto";
  }
}

// Every logits kernel on the fixture's q_fp4 / weights (the query stage ran), scores poisoned
// before each launch; the last path's scores stay in d_scores.
void check_logits_paths(Fixture& f) {
  for (cuda::IndexerLogitsPath path :
       {cuda::IndexerLogitsPath::kMma, cuda::IndexerLogitsPath::kWgmma}) {
    SCOPED_TRACE(logits_path_name(path));
    f.d_scores.fill_bytes(0xff);
    cuda::IndexerParams p = f.p;
    p.logits_path = path;
    cuda::indexer_logits(p, nullptr);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    check_scores(f);
  }
}

void run_all(Fixture& f) {
  cuda::lightning_indexer(f.p, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  check_query(f);
  check_scores(f);
  check_topk(f);
  check_logits_paths(f);
}

TEST_F(CudaIndexer, Smoke) {
  std::mt19937 rng(1);
  Fixture f(make_batch({1}, {40}), 8, 8, 16, rng);
  run_all(f);
}

TEST_F(CudaIndexer, QueryPathBitExact) {
  std::mt19937 rng(2);
  // Positions up to ~1M (long RoPE angles), several heads.
  for (int heads : {4, 8, 16, 64}) {
    Fixture f(make_batch({3, 1, 4}, {0, 1048000, 65535}), heads, 8, 64, rng);
    cuda::indexer_query(f.p, nullptr);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    check_query(f);
  }
  // Prefill-sized launches (kQueryPrefillTokens and more: several head rows a warp).
  for (int heads : {4, 12, 64}) {
    Fixture f(make_batch({300, 250, 7}, {0, 1000000, 65529}), heads, 8, 64, rng);
    cuda::indexer_query(f.p, nullptr);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    check_query(f);
  }
}

TEST_F(CudaIndexer, DecodeMixedLengths) {
  std::mt19937 rng(3);
  // 1-4 query tokens per sequence; sequences shorter than one block, exactly at block edges,
  // crossing page boundaries, and one long enough for several key tiles.
  // Head counts off the MMA widths (1, 4, 12, 40) run padded with zero heads.
  for (int heads : {1, 4, 8, 12, 16, 32, 40, 64})
    for (int page_size : {16, 64}) {
      Fixture f(make_batch({1, 2, 3, 4, 1, 2, 4}, {0, 2, 127, 4093, 511, 1023, 6000}), heads, 16,
                page_size, rng);
      f.p.pdl = page_size == 64;  // the first stage launched programmatically too (the engine's)
      run_all(f);
    }
}

TEST_F(CudaIndexer, PrefillChunks) {
  std::mt19937 rng(4);
  // A prompt from position 0 and a chunk in the middle of a sequence (positions crossing
  // 4-boundaries mid-chunk), plus a short one.
  for (int heads : {4, 16, 64}) {
    Fixture f(make_batch({301, 129, 3}, {0, 2047, 5}), heads, 512, 32, rng);
    run_all(f);
  }
}

// V4 shapes (64 heads) at long contexts: decode tokens (1-4 a sequence, the speculative
// verify's) at 16K-64K tokens of context (4K-16K entries, many key chunks a sequence) and a
// prefill chunk of 64 tokens at 8K, every logits kernel (the wgmma one with one and with two
// tokens a chain) against the CPU op.
TEST_F(CudaIndexer, LongContextV4Heads) {
  std::mt19937 rng(12);
  // Up to 2 tokens a sequence (one token a wgmma chain) and up to 64 (two tokens a chain).
  Fixture f2(make_batch({2, 1, 2}, {65534, 32767, 16381}), 64, 512, 64, rng);
  run_all(f2);
  Fixture f(make_batch({1, 2, 4, 3, 64}, {65535, 32766, 16380, 20001, 8192}), 64, 512, 64, rng);
  run_all(f);
}

TEST_F(CudaIndexer, TopkSizes) {
  std::mt19937 rng(5);
  for (int k : {8, 16, 512, 1024}) {
    Fixture f(make_batch({1, 1, 2, 1}, {k * 4 - 2, k * 4 - 1, 8191, 20}), 64, k, 64, rng);
    run_all(f);
  }
}

// Top-k alone on synthetic scores with many ties (few distinct BF16 values), one token per
// row with vis[i] visible entries, against cpu::topk_desc exactly, with `ctas` CTAs a row (0:
// the batch's choice) and rows 16-byte aligned (the engine's score stride, vector loads) or
// not (an odd stride: element loads).
void check_topk_rows(const std::vector<int>& vis, uint32_t seed, int ctas = 0,
                     bool aligned = true) {
  SCOPED_TRACE(testing::Message() << "CTAs a row " << ctas << (aligned ? ", aligned" : ", odd")
                                  << " stride");
  std::mt19937 rng(seed);
  std::vector<int> ntok(vis.size(), 1), pos0;
  for (int v : vis) pos0.push_back(4 * v + v % 3);  // (p + 1) / 4 == v
  Batch b = make_batch(ntok, pos0);
  for (size_t i = 0; i < vis.size(); ++i) ASSERT_EQ((b.pos_of(int(i)) + 1) / 4, vis[i]);
  for (int k : {8, 512, 1024}) {
    const int T = b.tokens();
    const int64_t stride =
        aligned ? ((b.max_pos() + 1) / 4 + 8) / 8 * 8 : (b.max_pos() + 1) / 4 + 3;
    std::vector<uint16_t> sc(size_t(T) * stride, 0xffff);
    std::uniform_int_distribution<int> few(0, 40);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < vis[t]; ++i) {
        // Mostly a handful of values (ties), some +-0, some continuous.
        const int r = few(rng);
        float v = r < 30 ? float(r % 6) - 2.0f : (r < 33 ? (r == 31 ? -0.0f : 0.0f) : nd(rng));
        sc[size_t(t) * stride + i] = float_to_bf16(v);
      }
    DeviceBuffer<int32_t> d_cu(b.cu), d_pos0(std::vector<int32_t>(b.pos0.begin(), b.pos0.end()));
    DeviceBuffer<uint16_t> d_sc(sc);
    DeviceBuffer<int32_t> d_idx(size_t(T) * k);
    d_idx.fill_bytes(0x7f);
    cuda::IndexerParams p;
    p.batch = {d_cu.data(), d_pos0.data(), int(b.ntok.size()), T, 1, b.max_pos()};
    p.n_heads = 64;
    p.topk = k;
    p.scores = reinterpret_cast<__nv_bfloat16*>(d_sc.data());
    p.score_stride = stride;
    p.topk_idx = d_idx.data();
    p.topk_ctas_per_row = ctas;
    cuda::indexer_topk(p, nullptr);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = d_idx.download();
    std::vector<float> row;
    std::vector<int32_t> want(k);
    for (int t = 0; t < T; ++t) {
      row.resize(vis[t]);
      for (int i = 0; i < vis[t]; ++i) row[i] = bf16_to_float(sc[size_t(t) * stride + i]);
      const int kk = cpu::topk_desc(row.data(), vis[t], k, want.data());
      int bad = 0;
      for (int r = 0; r < k; ++r) {
        const int32_t c = r < kk ? want[r] : -1, g = got[size_t(t) * k + r];
        if (c != g && bad++ < 3)
          ADD_FAILURE() << "k " << k << " visible " << vis[t] << " rank " << r << ": gpu " << g
                        << " cpu " << c;
      }
      EXPECT_EQ(bad, 0) << "k " << k << ", visible " << vis[t];
    }
  }
}

// Rows from empty to the 256K maximum (9 tokens: the batch's choice is 8 CTAs a row, 64
// entries a thread at 256K), aligned and odd strides.
TEST_F(CudaIndexer, TopkTiesAndRowLengths) {
  const std::vector<int> vis{0, 1, 7, 1024, 1025, 16384, 16385, 40000, 262144};
  check_topk_rows(vis, 6);
  check_topk_rows(vis, 6, 0, false);
}

// Every cluster size over rows up to 32760 entries (which one CTA holds: 64 a thread), so
// every chunk size (8, 16, 32, 64 entries a thread) runs, rows at and across the 8-entry chunk
// grain, rows shorter than the cluster, both strides; rows that do not fit the forced cluster
// are an error.
TEST_F(CudaIndexer, TopkEveryClusterSize) {
  const std::vector<int> vis{0, 1, 7, 8, 9, 1023, 1024, 4095, 4096, 4097, 16384, 16385, 32760};
  for (int ctas : {1, 2, 4, 8}) {
    check_topk_rows(vis, 10 + ctas, ctas);
    check_topk_rows(vis, 20 + ctas, ctas, false);
    check_topk_rows({3000, 5, 4096}, 30 + ctas, ctas);  // 8 entries a thread
  }
  EXPECT_THROW(check_topk_rows({40000}, 1, 1), Error);
  EXPECT_THROW(check_topk_rows({8}, 1, 3), Error);
}

// One token over 32K entries (128K tokens of context, issue 17's batch-1 target) and 2 tokens
// at 8193 / 65536.
TEST_F(CudaIndexer, TopkSmallBatch) {
  check_topk_rows({32768}, 7);
  check_topk_rows({8193, 65536}, 8);
}

// Larger batches: 24 tokens (rows of 40000, 16384 and short ones) by the batch's choice and
// forced to 2 and 8 CTAs a row; the engine's decode shapes at 64K context: 32 and 130 tokens of
// 16385 entries (by the batch's choice 4 CTAs a row at 16 entries a thread, and 2 at 24: one
// CTA would hold 40 a thread).
TEST_F(CudaIndexer, TopkLargeBatch) {
  std::vector<int> vis;
  for (int i = 0; i < 24; ++i) vis.push_back(i % 4 == 0 ? 40000 : (i % 4 == 1 ? 16384 : 100 * i));
  check_topk_rows(vis, 9);
  check_topk_rows(vis, 9, 2);
  check_topk_rows(vis, 9, 8);
  check_topk_rows(std::vector<int>(32, 16385), 12);
  check_topk_rows(std::vector<int>(130, 16385), 13);
}

// The whole indexer against the CPU pipeline from the same raw inputs: the CPU computes its
// own q_fp4 / weights / scores; selections must match exactly (q_fp4 is bit-exact, so the
// scores are too).
void end_to_end_against_cpu(int heads, int topk, uint32_t seed) {
  std::mt19937 rng(seed);
  Fixture f(make_batch({2, 64, 1}, {3001, 999, 70000}), heads, topk, 64, rng);
  cuda::lightning_indexer(f.p, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto rope = v4_yarn_table();
  const auto idx = f.d_topk.download();
  std::vector<float> q(size_t(f.heads) * kDim), w(f.heads), scores(f.stride);
  std::vector<int32_t> want(f.topk);
  int64_t bad = 0;
  for (int t = 0; t < f.batch.tokens(); ++t) {
    for (int h = 0; h < f.heads; ++h) {
      cpu_query(f, rope, t, h, q.data() + size_t(h) * kDim);
      w[h] = cpu_weight(f, t, h);
    }
    const int nvis = (f.batch.pos_of(t) + 1) / 4;
    cpu::indexer_scores(q.data(), w.data(), f.heads, kDim, f.keys.decoded[f.batch.seq_of(t)].data(),
                        nvis, scores.data());
    const int kk = cpu::topk_desc(scores.data(), nvis, f.topk, want.data());
    for (int r = 0; r < f.topk; ++r) {
      const int32_t c = r < kk ? want[r] : -1, g = idx[size_t(t) * f.topk + r];
      if (c != g && bad++ < 5)
        ADD_FAILURE() << "token " << t << " rank " << r << ": gpu " << g << " cpu " << c;
    }
  }
  EXPECT_EQ(bad, 0) << heads << " heads";
}

TEST_F(CudaIndexer, EndToEndAgainstCpuPipeline) {
  end_to_end_against_cpu(64, 512, 7);
}

// 4 heads (the custom config's index_n_heads): the logits kernel pads to 8 with zero heads.
TEST_F(CudaIndexer, EndToEndFourHeads) {
  end_to_end_against_cpu(4, 3, 8);
  end_to_end_against_cpu(4, 512, 9);
}

// Host-side validation only: runs without a GPU.
void expect_rejected(void (*fn)(const cuda::IndexerParams&, cudaStream_t),
                     const cuda::IndexerParams& p, const std::string& what) {
  try {
    fn(p, nullptr);
    ADD_FAILURE() << "accepted; expected an error mentioning '" << what << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(CudaIndexerHost, RejectsUnsupported) {
  cuda::IndexerParams p;
  p.n_heads = 65;
  expect_rejected(cuda::indexer_query, p, "n_heads 65");
  p.n_heads = 0;
  expect_rejected(cuda::indexer_logits, p, "n_heads 0");
  p.n_heads = 64;
  p.topk = 2048;
  expect_rejected(cuda::indexer_topk, p, "topk 2048");
  p.topk = 8;
  p.head_dim = 64;
  expect_rejected(cuda::indexer_logits, p, "head_dim 64");
  p.head_dim = 128;
  p.batch.max_position = 4 * (cuda::kIndexerMaxVisible + 1);
  p.score_stride = cuda::kIndexerMaxVisible + 2;
  expect_rejected(cuda::indexer_topk, p, "visible entries exceed");
}

}  // namespace
}  // namespace dsv4
