// Sparse attention at V4-Flash / V4-Pro shapes (issue 3, deliverable 7), beside FlashMLA's
// H200 figures from ../shared/spec/anchors.md. One JSON line per (kernel, shape).
//
// Decode: b sequences x s_q query tokens at context 16K, window 128 + compressed keys
// (Flash CSA top-512, Flash HCA all 128 visible entries, Pro CSA top-1024), random distinct
// top-k indices over the visible entries, caches on shuffled 64-entry pages, rotated past L2.
// Prefill: one 4096- (and 8192-) token chunk ending at context 8K (resp. 16K).
// FLOPs = 2 * s_q * heads * keys * (512 + 512), keys = window fill + compressed entries.
// Bytes = every query's keys once (584 B) + q + out.
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
#include "device_fill.cuh"
#include "kvcache/cache_layout.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/sparse_attention/sparse_attention.h"

using namespace dsv4;
using namespace dsv4::cuda;

namespace {

// Valid random cache bytes: e4m3 codes without NaN, UE8M0 scales near 2^-7, small BF16 RoPE.
__global__ void fill_kv_pages(uint8_t* pages, int64_t n_pages, int64_t page_bytes, int page_size,
                              uint32_t seed) {
  const int64_t n = n_pages * page_bytes;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t off = i % page_bytes;
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    uint8_t b = uint8_t(h);
    if (off < int64_t(page_size) * 576) {
      const int64_t in = off % 576;
      if (in < 448)
        b &= 0xb7;  // exponent <= 0110: never NaN
      else if (in % 2 == 1)
        b = 0x3c | (b & 0x80);  // BF16 high byte: |x| ~ 2^-7..2^-6
    } else if (off < int64_t(page_size) * 584) {
      b = 120 + (b & 3);
    } else {
      b = 0;
    }
    pages[i] = b;
  }
}

struct Shape {
  std::string name;
  int heads, ratio, topk;  // ratio 4: topk; ratio 128: all visible
  int b, sq;
  int64_t ctx;
  double peer_us;
  const char* peer;
  bool prefill = false;
};

constexpr int kWindow = 128, kPage = 64;

void run(const Shape& sh, std::mt19937& rng) {
  const int T = sh.b * sh.sq, H = sh.heads;
  // Positions: sequence s's tokens end at ctx - 1.
  std::vector<int32_t> cu{0}, pos0;
  for (int s = 0; s < sh.b; ++s) {
    cu.push_back(cu.back() + sh.sq);
    pos0.push_back(int32_t(sh.ctx - sh.sq));
  }
  const int64_t ncomp = sh.ctx / (sh.ratio ? sh.ratio : 1);
  const KvEntryLayout l;
  const int64_t page_bytes = l.page_bytes(kPage);
  const int win_pages = (kWindow + kPage - 1) / kPage;
  const int comp_pages = sh.ratio ? int((ncomp + kPage - 1) / kPage) : 1;
  const size_t bytes_per_copy = size_t(sh.b) * (win_pages + comp_pages) * page_bytes;
  const int copies = bench::rotation_copies(bytes_per_copy);
  const int64_t pages_per_copy = int64_t(sh.b) * (win_pages + comp_pages);
  DeviceBuffer<uint8_t> pages(size_t(copies) * pages_per_copy * page_bytes);
  fill_kv_pages<<<1024, 256>>>(pages.data(), copies * pages_per_copy, page_bytes, kPage, 1234u);
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
  // The batch's own window entries (staged), random too.
  DeviceBuffer<uint8_t> d_staged(size_t(T) * 584);
  fill_kv_pages<<<64, 256>>>(d_staged.data(), 1, int64_t(T) * 584, T, 99u);
  std::vector<float> sink(H, 0.5f);
  DeviceBuffer<float> d_sink(sink);

  SparseAttnParams p;
  p.batch = {d_cu.data(), d_pos0.data(), sh.b, T, sh.sq, sh.ctx - 1};
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
  // Every kernel that supports the head count, side by side (the first is the default).
  std::vector<SparseAttnKernel> kernels{SparseAttnKernel::kAuto};
  if (H % 64 == 0) kernels.push_back(SparseAttnKernel::kMma);
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
    // Keys attended per query: window fill (128 at this context) + compressed entries.
    const int64_t keys = kWindow + (sh.ratio == 4 ? K : (sh.ratio == 128 ? ncomp : 0));
    bench::Result r;
    r.kernel = plan.kernel == SparseAttnKernel::kWgmma ? "sparse_attention[wgmma]"
                                                       : "sparse_attention[mma]";
    char shape[256];
    std::snprintf(shape, sizeof shape, "%s h%d b=%d sq=%d ctx=%lld keys=%lld [ht %d splits %d]",
                  sh.name.c_str(), H, sh.b, sh.sq, (long long)sh.ctx, (long long)keys,
                  plan.heads_per_cta, plan.num_splits);
    r.shape = shape;
    r.us = us;
    r.flops = 2.0 * T * H * double(keys) * 1024.0;
    r.bytes = double(T) * keys * 584 + 2.0 * q_elems * 2;
    r.peer = sh.peer;
    r.peer_us = sh.peer_us;
    r.emit();
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::mt19937 rng(7);
  const char* fm = "FlashMLA H200 (anchors.md)";
  // FlashMLA decode, s_k = 16384, [H200] from anchors.md (0 = not in the table).
  struct Row {
    const char* name;
    int heads, ratio, topk, sq;
    double b2, b64, b128, b256;
  };
  const Row rows[] = {
      {"flash_csa", 64, 4, 512, 1, 15.0, 45.5, 49.3, 91.5},
      {"flash_csa", 64, 4, 512, 2, 14.6, 49.6, 91.1, 174.4},
      {"flash_hca", 64, 128, 0, 1, 13.1, 43.7, 76.1, 121.1},
      {"flash_hca", 64, 128, 0, 2, 0, 0, 0, 0},
      {"pro_csa", 128, 4, 1024, 1, 0, 0, 0, 0},
      {"pro_csa", 128, 4, 1024, 2, 17.2, 105.3, 204.9, 402.4},
  };
  const int batches[] = {1, 2, 32, 64, 128, 256};
  for (const Row& row : rows)
    for (int b : batches) {
      if (quick && b != 2 && b != 128) continue;
      const double peer = b == 2     ? row.b2
                          : b == 64  ? row.b64
                          : b == 128 ? row.b128
                          : b == 256 ? row.b256
                                     : 0;
      run({row.name, row.heads, row.ratio, row.topk, b, row.sq, 16384, peer, peer > 0 ? fm : ""},
          rng);
    }
  // Prefill: FlashMLA sparse prefill, s_q 4096, [H200]: 64 heads top-512 531 TFLOPS at s_kv 8K,
  // 128 heads top-1024 625 TFLOPS (peer_us = our FLOPs at their rate).
  for (int sq : {4096, 8192}) {
    for (int pro = 0; pro < 2; ++pro) {
      const int heads = pro ? 128 : 64, topk = pro ? 1024 : 512;
      const double tf = pro ? 625.0 : 531.0;
      const int64_t ctx = sq == 4096 ? 8192 : 16384;
      const double flops = 2.0 * sq * heads * double(kWindow + topk) * 1024.0;
      run({pro ? "pro_csa_prefill" : "flash_csa_prefill", heads, 4, topk, 1, sq, ctx,
           sq == 4096 ? flops / (tf * 1e6) : 0.0, sq == 4096 ? fm : "", true},
          rng);
      if (quick) break;
    }
  }
  return 0;
}
