// The inputs of one sparse-attention benchmark shape, shared by sparse_attention_bench.cu and
// the FlashMLA side-by-side (bench/flashmla/): caches on shuffled 64-entry pages filled with
// real encodings, block tables per rotation copy (the copies together exceed twice the L2),
// top-k rows, queries, sinks and staged window entries.
//
// Cache contents: a pool of 4096 keys with N(0, 1) values times a per-key magnitude 2^U(-3, 3),
// rounded to BF16 and encoded by the reference encoder (cpu::encode_kv_entry: e4m3 with UE8M0
// scales from each 64-block's amax, BF16 RoPE), tiled over every page. Sinks N(0, 1); queries
// BF16 of about unit variance.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/formats.h"
#include "device_fill.cuh"
#include "kvcache/cache_layout.h"
#include "ops/cpu/cache_codec.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/sparse_attention/sparse_attention.h"

namespace dsv4::bench::sparse_attn {

using cuda::DeviceBuffer;

constexpr int kWindow = 128, kPage = 64, kPoolPages = 64;

// Tiles `pool` (pool_bytes, whole pages, a multiple of 16) over n bytes of pages.
__global__ void tile_pages(uint8_t* pages, int64_t n, const uint8_t* pool, int64_t pool_bytes) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n / 16;
       i += int64_t(gridDim.x) * blockDim.x)
    reinterpret_cast<uint4*>(pages)[i] =
        reinterpret_cast<const uint4*>(pool)[i % (pool_bytes / 16)];
}

// The pool of encoded keys (see the top comment), kPoolPages pages of kPage entries.
inline std::vector<uint8_t> encoded_pool(std::mt19937& rng) {
  const KvEntryLayout l;
  std::vector<uint8_t> pool(size_t(kPoolPages) * l.page_bytes(kPage), 0);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> kv(512);
  for (int pg = 0; pg < kPoolPages; ++pg)
    for (int e = 0; e < kPage; ++e) {
      const float mag = std::exp2(u(rng));
      for (float& v : kv) v = round_bf16(nd(rng) * mag);
      uint8_t* page = pool.data() + size_t(pg) * l.page_bytes(kPage);
      cpu::encode_kv_entry(l, kv.data(), page + l.data_offset(e), page + l.scale_offset(kPage, e));
    }
  return pool;
}

struct Shape {
  std::string name;
  int heads, ratio, topk;  // ratio 4: topk; ratio 128: all visible
  int b, sq;
  int64_t ctx;
  double peer_us;
  const char* peer;
  bool prefill = false;
  int hca_max_entries = 0;  // > 0: sequence s ends at 128 n_s + 127, n_s ~ U[1, this]
  bool staged = true;       // false: every window entry read from the ring (the side-by-side)
};

// Device inputs of one shape; params(c) binds rotation copy c.
struct Inputs {
  Shape sh;
  int T = 0, H = 0, K = 0, copies = 0, win_pages = 0, comp_pages = 0;
  int64_t max_pos = 0, page_bytes = 0;
  double keys = 0;  // keys attended, summed over the query tokens
  std::vector<int32_t> cu, pos0, idx;
  std::vector<std::vector<int32_t>> wt, ct;  // per copy: window / compressed block tables
  DeviceBuffer<uint8_t> pages, staged;
  std::vector<DeviceBuffer<int32_t>> d_wt, d_ct;
  DeviceBuffer<int32_t> d_idx, d_cu, d_pos0;
  DeviceBuffer<uint16_t> q, out;
  std::vector<float> sink;
  DeviceBuffer<float> d_sink;

  Inputs(const Shape& shape, const DeviceBuffer<uint8_t>& pool, std::mt19937& rng) : sh(shape) {
    T = sh.b * sh.sq;
    H = sh.heads;
    // Positions: sequence s's tokens end at ctx - 1 (HCA <= 1024: at 128 n_s + 127).
    cu.push_back(0);
    std::uniform_int_distribution<int> n_hca(1, std::max(1, sh.hca_max_entries));
    for (int s = 0; s < sh.b; ++s) {
      cu.push_back(cu.back() + sh.sq);
      const int64_t last = sh.hca_max_entries ? 128 * int64_t(n_hca(rng)) + 127 : sh.ctx - 1;
      pos0.push_back(int32_t(last - sh.sq + 1));
      max_pos = std::max(max_pos, last);
    }
    const int64_t ncomp =
        sh.hca_max_entries ? sh.hca_max_entries : sh.ctx / (sh.ratio ? sh.ratio : 1);
    const KvEntryLayout l;
    page_bytes = l.page_bytes(kPage);
    win_pages = (kWindow + kPage - 1) / kPage;
    comp_pages = sh.ratio ? int((ncomp + kPage - 1) / kPage) : 1;
    const int64_t pages_per_copy = int64_t(sh.b) * (win_pages + comp_pages);
    copies = bench::rotation_copies(size_t(pages_per_copy) * page_bytes);
    pages = DeviceBuffer<uint8_t>(size_t(copies) * pages_per_copy * page_bytes);
    tile_pages<<<1024, 256>>>(pages.data(), int64_t(pages.size()), pool.data(),
                              int64_t(pool.size()));
    DSV4_CUDA_CHECK(cudaGetLastError());
    // Block tables per copy: window pages then compressed pages, shuffled within the copy.
    wt.resize(copies);
    ct.resize(copies);
    for (int c = 0; c < copies; ++c) {
      std::vector<int32_t> ids(pages_per_copy);
      std::iota(ids.begin(), ids.end(), int32_t(c * pages_per_copy));
      std::shuffle(ids.begin(), ids.end(), rng);
      size_t k = 0;
      for (int s = 0; s < sh.b; ++s)
        for (int i = 0; i < win_pages; ++i) wt[c].push_back(ids[k++]);
      for (int s = 0; s < sh.b; ++s)
        for (int i = 0; i < comp_pages; ++i) ct[c].push_back(ids[k++]);
      d_wt.emplace_back(wt[c]);
      d_ct.emplace_back(ct[c]);
    }
    // Top-k rows: distinct random visible entries.
    K = sh.ratio == 4 ? int(std::min<int64_t>(sh.topk, ncomp)) : 0;
    idx.assign(std::max(1, T * K), -1);
    for (int t = 0; t < T && K > 0; ++t) {
      const int64_t vis = (position(t) + 1) / 4;
      std::vector<int32_t> pick;
      std::uniform_int_distribution<int64_t> u(0, vis - 1);
      std::vector<char> used(vis, 0);
      while (int(pick.size()) < std::min<int64_t>(K, vis)) {
        const int64_t v = u(rng);
        if (!used[v]) used[v] = 1, pick.push_back(int32_t(v));
      }
      while (int(pick.size()) < K) pick.push_back(-1);
      std::copy(pick.begin(), pick.end(), idx.begin() + size_t(t) * K);
    }
    for (int t = 0; t < T; ++t) {
      const int64_t pos = position(t);
      keys += std::min<int64_t>(kWindow, pos + 1) +
              (sh.ratio == 4 ? K : (sh.ratio == 128 ? (pos + 1) / 128 : 0));
    }
    d_idx = DeviceBuffer<int32_t>(idx);
    d_cu = DeviceBuffer<int32_t>(cu);
    d_pos0 = DeviceBuffer<int32_t>(pos0);
    const size_t q_elems = size_t(T) * H * 512;
    q = DeviceBuffer<uint16_t>(q_elems);
    out = DeviceBuffer<uint16_t>(q_elems);
    bench::fill_bf16_triangular_kernel<<<1024, 256>>>(q.data(), int64_t(q_elems), 77u);
    DSV4_CUDA_CHECK(cudaGetLastError());
    // The batch's own window entries (staged): pool entries, data rows then scale rows.
    {
      const auto host_pool = pool.download();
      std::vector<uint8_t> st(size_t(T) * 584);
      for (int t = 0; t < T; ++t) {
        const int e = t % (kPoolPages * kPage), pg = e / kPage, slot = e % kPage;
        const uint8_t* page = host_pool.data() + size_t(pg) * page_bytes;
        std::memcpy(&st[size_t(t) * 576], page + l.data_offset(slot), 576);
        std::memcpy(&st[size_t(T) * 576 + size_t(t) * 8], page + l.scale_offset(kPage, slot), 8);
      }
      staged = DeviceBuffer<uint8_t>(st);
    }
    sink.resize(H);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& v : sink) v = nd(rng);
    d_sink = DeviceBuffer<float>(sink);
  }

  int64_t position(int t) const { return pos0[t / sh.sq] + t % sh.sq; }

  cuda::SparseAttnParams params(int c) {
    cuda::SparseAttnParams p;
    p.batch = {d_cu.data(), d_pos0.data(), sh.b, T, sh.sq, max_pos};
    p.n_heads = H;
    p.softmax_scale = 1.0f / std::sqrt(512.0f);
    p.sink = d_sink.data();
    p.q = reinterpret_cast<const __nv_bfloat16*>(q.data());
    p.out = reinterpret_cast<__nv_bfloat16*>(out.data());
    p.window = kWindow;
    if (sh.staged) {
      p.staged_data = staged.data();
      p.staged_scales = staged.data() + size_t(T) * 576;
    }
    p.ratio = sh.ratio;
    p.topk_idx = d_idx.data();
    p.topk = K;
    p.topk_stride = std::max(K, 1);
    p.window_cache = cuda::kv_store_view(pages.data(), kPage, d_wt[c].data(), win_pages);
    p.comp_cache = cuda::kv_store_view(pages.data(), kPage, d_ct[c].data(), comp_pages);
    return p;
  }
};

}  // namespace dsv4::bench::sparse_attn
