// Lightning indexer at V4-Flash / V4-Pro shapes (real_config.h; issue 3, deliverable 7): the
// three stages (query path, logits, top-k) and the whole indexer, one JSON line each per shape.
//
// Decode: b sequences x s_q (next_n) tokens at context 16K, 64K and 128K (64 indexer heads,
// top-512 Flash / top-1024 Pro), MXFP4 keys on shuffled 64-entry pages, rotated past L2.
// Prefill: one 4096- / 8192-token prompt from position 0 (causal: token p sees (p+1)/4 keys).
// Logits report bytes = MXFP4 key bytes read (68 B per visible key per sequence and 4-token
// tile), the issue's target metric (>= 3 TB/s at 64K-128K), and FLOPs = 2 * tokens * visible
// * heads * 128. The peer line for b=256 8K is DeepGEMM's published SM90 paged MQA logits on
// H20 (a different chip: context only).
//
// Usage: indexer_bench [--quick] [--topk] [--logits] [--shape SUBSTR]
// (--topk: only the top-k at batch 1-128, every cluster size side by side;
//  --logits: only the logits, every kernel (IndexerLogitsPath) side by side;
//  --shape: only the shapes whose "name hH b=B sq=S ctx=C topk=K" contains SUBSTR)
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/error.h"
#include "device_fill.cuh"
#include "kvcache/cache_layout.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/indexer/indexer.h"
#include "ops/cuda/indexer/indexer_internal.h"
#include "real_config.h"

using namespace dsv4;
using namespace dsv4::cuda;

namespace {

bool g_topk_only = false;       // --topk
bool g_logits_only = false;     // --logits
const char* g_shape = nullptr;  // --shape SUBSTR: only shapes whose name contains SUBSTR

// Mean time per call of `n` calls enqueued back to back between two events.
double back_to_back_us(const std::function<void()>& call, int n) {
  for (int i = 0; i < 5; ++i) call();
  cudaEvent_t a, b;
  DSV4_CUDA_CHECK(cudaEventCreate(&a));
  DSV4_CUDA_CHECK(cudaEventCreate(&b));
  DSV4_CUDA_CHECK(cudaEventRecord(a));
  for (int i = 0; i < n; ++i) call();
  DSV4_CUDA_CHECK(cudaEventRecord(b));
  DSV4_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  DSV4_CUDA_CHECK(cudaEventDestroy(a));
  DSV4_CUDA_CHECK(cudaEventDestroy(b));
  return 1000.0 * ms / n;
}

__global__ void fill_bytes_hash(uint8_t* p, int64_t n, int64_t page_bytes, int page_size,
                                uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const int64_t off = i % page_bytes;
    uint8_t b = uint8_t(h);
    if (off >= int64_t(page_size) * 64)
      b = off < int64_t(page_size) * 68 ? uint8_t(124 + (b & 3)) : 0;
    p[i] = b;
  }
}

constexpr int kPage = 64;

struct Shape {
  std::string name;
  int heads;  // indexer heads
  int b, sq;
  int64_t ctx;
  int topk;
  bool prefill;
  double peer_logits_us;
};

// A shape of a real model (real_config.h): its indexer heads and top-k.
Shape model_shape(const char* name, const ModelConfig& c, int b, int sq, int64_t ctx, bool prefill,
                  double peer_logits_us) {
  return {name, c.index_n_heads, b, sq, ctx, c.index_topk, prefill, peer_logits_us};
}

void run(const Shape& sh, std::mt19937& rng) {
  char shape[200];
  std::snprintf(shape, sizeof shape, "%s h%d b=%d sq=%d ctx=%lld topk=%d", sh.name.c_str(),
                sh.heads, sh.b, sh.sq, (long long)sh.ctx, sh.topk);
  if (g_shape && !std::strstr(shape, g_shape)) return;
  const int T = sh.b * sh.sq;
  std::vector<int32_t> cu{0}, pos0;
  for (int s = 0; s < sh.b; ++s) {
    cu.push_back(cu.back() + sh.sq);
    pos0.push_back(sh.prefill ? 0 : int32_t(sh.ctx - sh.sq));
  }
  const int64_t nkeys = sh.ctx / 4;  // entries visible to the last token
  const IndexKeyLayout l;
  const int64_t page_bytes = l.page_bytes(kPage);
  const int pages_per_seq = int((nkeys + kPage - 1) / kPage);
  const int64_t pages_per_copy = int64_t(sh.b) * pages_per_seq;
  const int copies = bench::rotation_copies(size_t(pages_per_copy * page_bytes));
  DeviceBuffer<uint8_t> pages(size_t(copies) * pages_per_copy * page_bytes);
  fill_bytes_hash<<<1024, 256>>>(pages.data(), int64_t(pages.size()), page_bytes, kPage, 5u);
  std::vector<DeviceBuffer<int32_t>> tables;
  for (int c = 0; c < copies; ++c) {
    std::vector<int32_t> ids(pages_per_copy);
    std::iota(ids.begin(), ids.end(), int32_t(c * pages_per_copy));
    std::shuffle(ids.begin(), ids.end(), rng);
    tables.emplace_back(ids);
  }
  const size_t qn = size_t(T) * sh.heads * 128;
  DeviceBuffer<uint16_t> d_q(qn), d_wp(size_t(T) * sh.heads), d_qfp4(qn), d_w(size_t(T) * sh.heads);
  bench::fill_bf16_triangular_kernel<<<1024, 256>>>(d_q.data(), int64_t(qn), 3u);
  bench::fill_bf16_triangular_kernel<<<64, 256>>>(d_wp.data(), int64_t(T) * sh.heads, 4u);
  std::vector<float> inv(32);
  for (int i = 0; i < 32; ++i) inv[i] = std::pow(160000.0f, -float(2 * i) / 64.0f);
  DeviceBuffer<float> d_inv(inv);
  DeviceBuffer<int32_t> d_cu(cu), d_pos0(pos0);
  const int64_t stride = nkeys;
  DeviceBuffer<uint16_t> d_scores(size_t(T) * stride);
  DeviceBuffer<int32_t> d_idx(size_t(T) * sh.topk);

  IndexerParams p;
  p.batch = {d_cu.data(), d_pos0.data(), sh.b, T, sh.sq, sh.ctx - 1};
  p.n_heads = sh.heads;
  p.topk = sh.topk;
  p.q = reinterpret_cast<const __nv_bfloat16*>(d_q.data());
  p.wproj = reinterpret_cast<const __nv_bfloat16*>(d_wp.data());
  p.inv_freq = d_inv.data();
  p.q_fp4 = reinterpret_cast<__nv_bfloat16*>(d_qfp4.data());
  p.weights = reinterpret_cast<__nv_bfloat16*>(d_w.data());
  p.scores = reinterpret_cast<__nv_bfloat16*>(d_scores.data());
  p.score_stride = stride;
  p.topk_idx = d_idx.data();
  auto bind = [&](int c) {
    p.keys = index_store_view(pages.data(), kPage, tables[c].data(), pages_per_seq);
  };
  bind(0);
  indexer_query(p, nullptr);  // realistic q_fp4 / weights for the later stages

  // Visible entries summed over tokens; key bytes: each CTA (4-token tile) reads its keys once.
  double vis_sum = 0, key_bytes = 0;
  for (int s = 0; s < sh.b; ++s)
    for (int t0 = 0; t0 < sh.sq; t0 += 4) {
      const int nt = std::min(4, sh.sq - t0);
      key_bytes += double((pos0[s] + t0 + nt) / 4) * 68.0;
      for (int t = t0; t < t0 + nt; ++t) vis_sum += double((pos0[s] + t + 1) / 4);
    }
  auto emit = [&](const char* kernel, double us, double flops, double bytes, const char* peer,
                  double peer_us) {
    bench::Result r;
    r.kernel = kernel;
    r.shape = shape;
    r.us = us;
    r.flops = flops;
    r.bytes = bytes;
    r.peer = peer;
    r.peer_us = peer_us;
    r.emit();
  };
  if (g_topk_only) {
    indexer_logits(p, nullptr);  // real scores for the top-k
    const int auto_ctas = indexer_detail::topk_plan(p).ctas_per_row;
    for (int ctas : {0, 1, 2, 4, 8}) {
      p.topk_ctas_per_row = ctas;
      try {
        indexer_detail::topk_plan(p);
      } catch (const Error&) {
        continue;  // the rows do not fit that many CTAs
      }
      char name[64], b2b_name[80];
      std::snprintf(name, sizeof name, "indexer_topk[%s%d CTAs a row]",
                    ctas ? "" : "auto: ", ctas ? ctas : auto_ctas);
      std::snprintf(b2b_name, sizeof b2b_name, "%s back to back", name);
      const double us = bench::median_us([&](int) { indexer_topk(p, nullptr); });
      emit(name, us, 0, vis_sum * 2, "", 0);
      // The same launches back to back (200 between two events): the device time per call
      // without the host's launch latency, which the single-launch timer above includes.
      const double b2b = back_to_back_us([&] { indexer_topk(p, nullptr); }, 200);
      emit(b2b_name, b2b, 0, vis_sum * 2, "", 0);
    }
    return;
  }
  if (g_logits_only) {
    for (IndexerLogitsPath path : {IndexerLogitsPath::kMma, IndexerLogitsPath::kWgmma}) {
      p.logits_path = path;
      const double us = bench::median_us([&](int i) {
        bind(i % copies);
        indexer_logits(p, nullptr);
      });
      emit(path == IndexerLogitsPath::kMma ? "indexer_logits[mma]" : "indexer_logits[wgmma]", us,
           2.0 * vis_sum * sh.heads * 128, key_bytes, "", 0);
    }
    return;
  }
  const double tq = bench::median_us([&](int) { indexer_query(p, nullptr); });
  emit("indexer_query", tq, 0, double(qn) * 4 + double(T) * sh.heads * 4, "", 0);
  const double tl = bench::median_us([&](int i) {
    bind(i % copies);
    indexer_logits(p, nullptr);
  });
  emit("indexer_logits", tl, 2.0 * vis_sum * sh.heads * 128, key_bytes,
       sh.peer_logits_us > 0 ? "DeepGEMM SM90 paged MQA logits [pub, H20]" : "", sh.peer_logits_us);
  const double tk = bench::median_us([&](int) { indexer_topk(p, nullptr); });
  emit("indexer_topk", tk, 0, vis_sum * 2, "", 0);
  const double ta = bench::median_us([&](int i) {
    bind(i % copies);
    lightning_indexer(p, nullptr);
  });
  emit("lightning_indexer", ta, 2.0 * vis_sum * sh.heads * 128, key_bytes, "", 0);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--topk") == 0) {
      g_topk_only = true;
    } else if (std::strcmp(argv[i], "--logits") == 0) {
      g_logits_only = true;
    } else if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc) {
      g_shape = argv[++i];
    } else {
      std::fprintf(stderr, "usage: indexer_bench [--quick] [--topk] [--logits] [--shape SUBSTR]\n");
      return 2;
    }
  }
  std::mt19937 rng(11);
  const ModelConfig flash = bench::real_config("flash", false),
                    pro = bench::real_config("pro", false);
  if (g_topk_only) {  // decode top-k over 4K / 16K / 32K entries, both paths
    // Every cluster size beside the batch's choice, batch 1-128.
    // 65540: 16385 entries, the engine's rows at 64K context (one past a multiple of 4096).
    for (int64_t ctx : {16384LL, 65536LL, 65540LL, 131072LL})
      for (int sq : {1, 2})
        for (int b : {1, 2, 8, 32, 128}) {
          if (sq == 2 && b > 2) continue;
          run(model_shape("decode_flash", flash, b, sq, ctx, false, 0), rng);
          if (ctx == 131072 && sq == 1)
            run(model_shape("decode_pro", pro, b, sq, ctx, false, 0), rng);
        }
    return 0;
  }
  if (g_logits_only) {
    for (int64_t ctx : {16384LL, 65536LL, 131072LL})
      for (int sq : {1, 2, 4})
        for (int b : {1, 2, 128, 256}) {
          if (sq == 4 && b == 256) continue;
          run(model_shape("decode_flash", flash, b, sq, ctx, false, 0), rng);
        }
    run(model_shape("decode_pro", pro, 128, 2, 65536, false, 0), rng);
    for (int64_t n : {4096LL, 8192LL})
      run(model_shape("prefill_flash", flash, 1, int(n), n, true, 0), rng);
    return 0;
  }
  for (int64_t ctx : {16384LL, 65536LL, 131072LL})
    for (int sq : {1, 2, 4})
      for (int b : {1, 2, 32, 64, 128, 256}) {
        if (quick && (b == 32 || b == 64 || sq == 4)) continue;
        // Device memory of the key cache: b * ctx/4 * 68 B (2.3 GB at b=256, 128K).
        run(model_shape("decode_flash", flash, b, sq, ctx, false, 0), rng);
      }
  run(model_shape("decode_pro", pro, 128, 2, 65536, false, 0), rng);
  // DeepGEMM's published point (H20): B=256, 8K context, next_n 1 / 2.
  run(model_shape("decode_flash", flash, 256, 1, 8192, false, 131.0), rng);
  run(model_shape("decode_flash", flash, 256, 2, 8192, false, 252.0), rng);
  for (int64_t n : {4096LL, 8192LL})
    run(model_shape("prefill_flash", flash, 1, int(n), n, true, 0), rng);
  if (!quick) run(model_shape("prefill_pro", pro, 1, 8192, 8192, true, 0), rng);
  return 0;
}
