// Sparse attention at V4-Flash / V4-Pro shapes (issues 3 and 17), beside FlashMLA's H200
// figures from ../shared/spec/anchors.md (its side-by-side table: same cache bytes, same
// timer). One JSON line per (kernel, shape); the shape names the planner's choice (kernel,
// heads per CTA, key splits) and its cost model's estimate, beside the measured time.
//
// Decode: b sequences x s_q query tokens at context 16K, window 128 + compressed keys
// (Flash CSA top-512, Flash HCA all 128 visible entries, Pro CSA top-1024), random distinct
// top-k indices over the visible entries, caches on shuffled 64-entry pages, rotated past L2.
// "flash_hca1024": every sequence sees U[1, 1024] HCA entries (its last position is
// 128 n + 127), as FlashMLA's own test and the anchors' "<= 1024 entries" rows do.
// Prefill: one 4096- (and 8192-) token chunk ending at context 8K (resp. 16K).
// Cache contents: real encodings, not a constant fill: a pool of 4096 keys with N(0, 1) values
// times a per-key magnitude 2^U(-3, 3), rounded to BF16 and encoded by the reference encoder
// (cpu::encode_kv_entry: e4m3 with UE8M0 scales from each 64-block's amax, BF16 RoPE), tiled
// over every page; the sinks N(0, 1); the workspace is the one the planner sizes.
// FLOPs = 2 * heads * (512 + 512) * keys summed over the query tokens, keys = window fill +
// compressed entries. Bytes = every query's keys once (584 B) + q + out.
//
// Usage: sparse_attention_bench [--quick]
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
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
#include "ops/cuda/sparse_attention/sparse_attention.h"

using namespace dsv4;
using namespace dsv4::cuda;

namespace {

int sm_count() {
  int dev = 0, v = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&dev));
  DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
  return v;
}

// Tiles `pool` (pool_bytes, whole pages) over n bytes of pages.
__global__ void tile_pages(uint8_t* pages, int64_t n, const uint8_t* pool, int64_t pool_bytes) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n / 16;
       i += int64_t(gridDim.x) * blockDim.x)
    reinterpret_cast<uint4*>(pages)[i] =
        reinterpret_cast<const uint4*>(pool)[i % (pool_bytes / 16)];
}

// A pool of encoded keys on pages of kPage entries (see the top comment).
std::vector<uint8_t> encoded_pool(int n_pages, int page_size, std::mt19937& rng) {
  const KvEntryLayout l;
  std::vector<uint8_t> pool(size_t(n_pages) * l.page_bytes(page_size), 0);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> kv(512);
  for (int pg = 0; pg < n_pages; ++pg)
    for (int e = 0; e < page_size; ++e) {
      const float mag = std::exp2(u(rng));
      for (float& v : kv) v = round_bf16(nd(rng) * mag);
      uint8_t* page = pool.data() + size_t(pg) * l.page_bytes(page_size);
      cpu::encode_kv_entry(l, kv.data(), page + l.data_offset(e),
                           page + l.scale_offset(page_size, e));
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
};

constexpr int kWindow = 128, kPage = 64, kPoolPages = 64;

void run(const Shape& sh, const DeviceBuffer<uint8_t>& pool, std::mt19937& rng) {
  const int T = sh.b * sh.sq, H = sh.heads;
  // Positions: sequence s's tokens end at ctx - 1 (HCA <= 1024: at 128 n_s + 127).
  std::vector<int32_t> cu{0}, pos0;
  std::uniform_int_distribution<int> n_hca(1, std::max(1, sh.hca_max_entries));
  int64_t max_pos = 0;
  for (int s = 0; s < sh.b; ++s) {
    cu.push_back(cu.back() + sh.sq);
    const int64_t last = sh.hca_max_entries ? 128 * int64_t(n_hca(rng)) + 127 : sh.ctx - 1;
    pos0.push_back(int32_t(last - sh.sq + 1));
    max_pos = std::max(max_pos, last);
  }
  const int64_t ncomp =
      sh.hca_max_entries ? sh.hca_max_entries : sh.ctx / (sh.ratio ? sh.ratio : 1);
  const KvEntryLayout l;
  const int64_t page_bytes = l.page_bytes(kPage);
  const int win_pages = (kWindow + kPage - 1) / kPage;
  const int comp_pages = sh.ratio ? int((ncomp + kPage - 1) / kPage) : 1;
  const size_t bytes_per_copy = size_t(sh.b) * (win_pages + comp_pages) * page_bytes;
  const int copies = bench::rotation_copies(bytes_per_copy);
  const int64_t pages_per_copy = int64_t(sh.b) * (win_pages + comp_pages);
  DeviceBuffer<uint8_t> pages(size_t(copies) * pages_per_copy * page_bytes);
  tile_pages<<<1024, 256>>>(pages.data(), int64_t(pages.size()), pool.data(), int64_t(pool.size()));
  DSV4_CUDA_CHECK(cudaGetLastError());
  // Block tables per copy: window pages then compressed pages, shuffled within the copy.
  std::vector<std::vector<int32_t>> wt(copies), ct(copies);
  for (int c = 0; c < copies; ++c) {
    std::vector<int32_t> ids(pages_per_copy);
    std::iota(ids.begin(), ids.end(), int32_t(c * pages_per_copy));
    std::shuffle(ids.begin(), ids.end(), rng);
    size_t k = 0;
    for (int s = 0; s < sh.b; ++s)
      for (int i = 0; i < win_pages; ++i) wt[c].push_back(ids[k++]);
    for (int s = 0; s < sh.b; ++s)
      for (int i = 0; i < comp_pages; ++i) ct[c].push_back(ids[k++]);
  }
  std::vector<DeviceBuffer<int32_t>> d_wt, d_ct;
  for (int c = 0; c < copies; ++c) {
    d_wt.emplace_back(wt[c]);
    d_ct.emplace_back(ct[c]);
  }
  // Top-k rows: distinct random visible entries.
  const int K = sh.ratio == 4 ? std::min<int64_t>(sh.topk, ncomp) : 0;
  std::vector<int32_t> idx(std::max(1, T * K));
  for (int t = 0; t < T && K > 0; ++t) {
    const int64_t vis = (sh.ctx - sh.sq + t % sh.sq + 1) / 4;
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
  DeviceBuffer<int32_t> d_idx(idx), d_cu(cu), d_pos0(pos0);
  const size_t q_elems = size_t(T) * H * 512;
  DeviceBuffer<uint16_t> d_q(q_elems), d_out(q_elems);
  bench::fill_bf16_triangular_kernel<<<1024, 256>>>(d_q.data(), int64_t(q_elems), 77u);
  DSV4_CUDA_CHECK(cudaGetLastError());
  // The batch's own window entries (staged): pool entries, data rows then scale rows.
  DeviceBuffer<uint8_t> d_staged(size_t(T) * 584);
  {
    const KvEntryLayout kl;
    const auto host_pool = pool.download();
    std::vector<uint8_t> st(size_t(T) * 584);
    for (int t = 0; t < T; ++t) {
      const int e = t % (kPoolPages * kPage), pg = e / kPage, slot = e % kPage;
      const uint8_t* page = host_pool.data() + size_t(pg) * page_bytes;
      std::memcpy(&st[size_t(t) * 576], page + kl.data_offset(slot), 576);
      std::memcpy(&st[size_t(T) * 576 + size_t(t) * 8], page + kl.scale_offset(kPage, slot), 8);
    }
    d_staged.upload(st);
  }
  std::vector<float> sink(H);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& v : sink) v = nd(rng);
  DeviceBuffer<float> d_sink(sink);

  SparseAttnParams p;
  p.batch = {d_cu.data(), d_pos0.data(), sh.b, T, sh.sq, max_pos};
  p.n_heads = H;
  p.softmax_scale = 1.0f / std::sqrt(512.0f);
  p.sink = d_sink.data();
  p.q = reinterpret_cast<const __nv_bfloat16*>(d_q.data());
  p.out = reinterpret_cast<__nv_bfloat16*>(d_out.data());
  p.window = kWindow;
  p.staged_data = d_staged.data();
  p.staged_scales = d_staged.data() + size_t(T) * 576;
  p.ratio = sh.ratio;
  p.topk_idx = d_idx.data();
  p.topk = K;
  p.topk_stride = std::max(K, 1);
  auto bind = [&](int c) {
    p.window_cache = kv_store_view(pages.data(), kPage, d_wt[c].data(), win_pages);
    p.comp_cache = kv_store_view(pages.data(), kPage, d_ct[c].data(), comp_pages);
  };
  bind(0);
  // The planner's choice, and the wgmma kernel beside it where it runs the head count (the
  // measurements behind the kernel table of sparse_attention_heuristics.h).
  std::vector<SparseAttnKernel> kernels{SparseAttnKernel::kAuto};
  if (H % 64 == 0) kernels.push_back(SparseAttnKernel::kWgmma);
  for (SparseAttnKernel k : kernels) {
    p.kernel = k;
    DeviceBuffer<uint8_t> ws(sparse_attention_workspace_bytes(p));
    p.workspace = ws.data();
    p.workspace_bytes = ws.size();
    const SparseAttnPlan plan = sparse_attention_plan(p);
    const double us = bench::median_us([&](int i) {
      bind(i % copies);
      sparse_attention(p, nullptr);
    });
    // Keys attended per query: window fill + compressed entries, summed over the tokens.
    double keys = 0;
    for (int t = 0; t < T; ++t) {
      const int64_t pos = pos0[t / sh.sq] + t % sh.sq;
      keys += std::min<int64_t>(kWindow, pos + 1) +
              (sh.ratio == 4 ? K : (sh.ratio == 128 ? (pos + 1) / 128 : 0));
    }
    SparseAttnShape model_shape;
    model_shape.num_tokens = T;
    model_shape.n_heads = H;
    model_shape.max_key_blocks = plan.max_key_blocks;
    model_shape.sm_count = sm_count();
    bench::Result r;
    r.kernel = plan.kernel == SparseAttnKernel::kWgmma ? "sparse_attention[wgmma]"
                                                       : "sparse_attention[mma]";
    char shape[256];
    std::snprintf(shape, sizeof shape,
                  "%s h%d b=%d sq=%d ctx=%lld keys/q=%.0f [%s ht %d splits %d, model %.0f us]",
                  sh.name.c_str(), H, sh.b, sh.sq, (long long)(max_pos + 1), keys / T,
                  k == SparseAttnKernel::kAuto ? "auto" : "forced", plan.heads_per_cta,
                  plan.num_splits, sparse_attention_model_us(model_shape, plan));
    r.shape = shape;
    r.us = us;
    r.flops = 2.0 * H * keys * 1024.0;
    r.bytes = keys * 584 + 2.0 * q_elems * 2;
    r.peer = sh.peer;
    r.peer_us = sh.peer_us;
    r.emit();
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::mt19937 rng(7);
  const char* fm = "FlashMLA H200 side by side (anchors.md)";
  // FlashMLA decode, s_k = 16384, from anchors.md's side-by-side table (0 = not measured).
  struct Row {
    const char* name;
    int heads, ratio, topk, sq, hca_max;
    double b2, b64, b128, b256;
  };
  const Row rows[] = {
      {"flash_csa", 64, 4, 512, 1, 0, 23.5, 52.8, 54.5, 96.0},
      {"flash_csa", 64, 4, 512, 2, 0, 24.3, 52.8, 93.9, 175.0},
      {"flash_hca", 64, 128, 0, 1, 0, 20.5, 28.8, 30.7, 52.2},
      {"flash_hca", 64, 128, 0, 2, 0, 20.8, 29.9, 49.3, 87.5},
      {"flash_hca1024", 64, 128, 0, 1, 1024, 21.4, 49.7, 77.4, 118.4},
      {"flash_hca1024", 64, 128, 0, 2, 1024, 24.2, 73.3, 119.6, 196.0},
      {"pro_csa", 128, 4, 1024, 1, 0, 0, 0, 0, 0},
      {"pro_csa", 128, 4, 1024, 2, 0, 26.6, 112.3, 213.1, 415.9},
  };
  const auto pool_host = encoded_pool(kPoolPages, kPage, rng);
  DeviceBuffer<uint8_t> pool(pool_host);
  const int batches[] = {1, 2, 32, 64, 128, 256};
  for (const Row& row : rows)
    for (int b : batches) {
      if (quick && b != 2 && b != 128) continue;
      const double peer = b == 2     ? row.b2
                          : b == 64  ? row.b64
                          : b == 128 ? row.b128
                          : b == 256 ? row.b256
                                     : 0;
      Shape sh{row.name, row.heads, row.ratio, row.topk,          b,
               row.sq,   16384,     peer,      peer > 0 ? fm : ""};
      sh.hca_max_entries = row.hca_max;
      run(sh, pool, rng);
    }
  // Prefill: s_q 4096 at context 8192 with the window, FlashMLA side by side 634 µs (Flash,
  // 64 heads top-512) and 1947 µs (Pro, 128 heads top-1024); s_q 8192 at 16K unmatched.
  for (int sq : {4096, 8192}) {
    for (int pro = 0; pro < 2; ++pro) {
      const int heads = pro ? 128 : 64, topk = pro ? 1024 : 512;
      const int64_t ctx = sq == 4096 ? 8192 : 16384;
      const double peer = sq == 4096 ? (pro ? 1947.0 : 634.0) : 0.0;
      run({pro ? "pro_csa_prefill" : "flash_csa_prefill", heads, 4, topk, 1, sq, ctx, peer,
           peer > 0 ? fm : "", true},
          pool, rng);
      if (quick) break;
    }
  }
  return 0;
}
