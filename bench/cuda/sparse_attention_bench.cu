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
// Cache contents: real encodings, not a constant fill (sparse_attention_inputs.cuh: keys with
// N(0, 1) values times a per-key magnitude 2^U(-3, 3) through the reference encoder); the sinks
// N(0, 1); the workspace is the engine's (64 MB, more where a forced plan needs it).
// FLOPs = 2 * heads * (512 + 512) * keys summed over the query tokens, keys = window fill +
// compressed entries. Bytes = every query's keys once (584 B) + q + out.
// The heads and CSA top-k are real_config.h's.
//
// Usage: sparse_attention_bench [--quick] [--no-prefill] [--batches 8,32,...] [--only NAME]
// (--quick: batches 2 and 128 only; --no-prefill: the decode shapes only; --batches: these;
// --only: the rows of this shape name only, e.g. flash_csa_prefill, for a profiler run)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/sparse_attention/sparse_attention.h"
#include "real_config.h"
#include "sparse_attention_inputs.cuh"

using namespace dsv4;
using namespace dsv4::cuda;
using namespace dsv4::bench::sparse_attn;

namespace {

void run(const Shape& sh, const DeviceBuffer<uint8_t>& pool, std::mt19937& rng) {
  Inputs in(sh, pool, rng);
  SparseAttnParams p = in.params(0);
  // The planner's choice, and beside it every kernel it does not pick for the head count:
  // mma, wgmma (staged producer) and wgmma_direct (the previous producer, old vs new on the
  // same inputs), wgmma_predecoded (keys decoded to BF16 once per launch, the pass timed with
  // it) — the measurements behind the kernel table of sparse_attention_heuristics.h.
  std::vector<SparseAttnKernel> kernels{SparseAttnKernel::kAuto};
  {
    SparseAttnParams pa = p;
    const SparseAttnKernel chosen = sparse_attention_plan(pa).kernel;
    std::vector<SparseAttnKernel> others{SparseAttnKernel::kMma};
    if (in.H % 64 == 0) {
      others.push_back(SparseAttnKernel::kWgmma);
      others.push_back(SparseAttnKernel::kWgmmaDirect);
      others.push_back(SparseAttnKernel::kWgmmaPredecoded);
    }
    if (in.H % 128 == 0) others.push_back(SparseAttnKernel::kWgmmaUnpaired);
    for (SparseAttnKernel k : others)
      if (k != chosen) kernels.push_back(k);
  }
  for (SparseAttnKernel k : kernels) {
    p.kernel = k;
    p.workspace = nullptr;
    p.workspace_bytes = 0;
    // The workspace the engine offers every launch (CudaModelLimits::attn_workspace_bytes, 64 MB
    // by default), or what a forced plan needs beyond it; kAuto plans within the offer.
    DeviceBuffer<uint8_t> ws(std::max<size_t>(sparse_attention_workspace_bytes(p), 64ull << 20));
    p.workspace = ws.data();
    p.workspace_bytes = ws.size();
    const SparseAttnPlan plan = sparse_attention_plan(p);
    const double us = bench::median_us([&](int i) {
      SparseAttnParams pi = in.params(i % in.copies);
      pi.kernel = p.kernel;
      pi.workspace = p.workspace;
      pi.workspace_bytes = p.workspace_bytes;
      sparse_attention(pi, nullptr);
    });
    const SparseAttnShape model_shape = sparse_attention_shape(p);
    bench::Result r;
    r.kernel =
        plan.kernel == SparseAttnKernel::kWgmma             ? "sparse_attention[wgmma]"
        : plan.kernel == SparseAttnKernel::kWgmmaDirect     ? "sparse_attention[wgmma_direct]"
        : plan.kernel == SparseAttnKernel::kWgmmaUnpaired   ? "sparse_attention[wgmma_unpaired]"
        : plan.kernel == SparseAttnKernel::kWgmmaPredecoded ? "sparse_attention[wgmma_predecoded]"
                                                            : "sparse_attention[mma]";
    char shape[256];
    std::snprintf(shape, sizeof shape,
                  "%s h%d b=%d sq=%d ctx=%lld keys/q=%.0f [%s ht %d splits %d, model %.0f us]",
                  sh.name.c_str(), in.H, sh.b, sh.sq, (long long)(in.max_pos + 1), in.keys / in.T,
                  k == SparseAttnKernel::kAuto ? "auto" : "forced", plan.heads_per_cta,
                  plan.num_splits, sparse_attention_model_us(model_shape, plan));
    r.shape = shape;
    r.us = us;
    r.flops = 2.0 * in.H * in.keys * 1024.0;
    r.bytes = in.keys * 584 + 2.0 * double(in.T) * in.H * 512 * 2;
    r.peer = sh.peer;
    r.peer_us = sh.peer_us;
    r.emit();
    if (sh.b <= 2 && k == SparseAttnKernel::kAuto && !sh.prefill) {
      // The latency path: the same calls back to back (200 between two events, inputs rotated),
      // the device time per call without the host's launch latency the timer above includes.
      auto call = [&](int i) {
        SparseAttnParams pi = in.params(i % in.copies);
        pi.workspace = p.workspace;
        pi.workspace_bytes = p.workspace_bytes;
        sparse_attention(pi, nullptr);
      };
      for (int i = 0; i < 5; ++i) call(i);
      cudaEvent_t ea, eb;
      DSV4_CUDA_CHECK(cudaEventCreate(&ea));
      DSV4_CUDA_CHECK(cudaEventCreate(&eb));
      DSV4_CUDA_CHECK(cudaEventRecord(ea));
      constexpr int kCalls = 200;
      for (int i = 0; i < kCalls; ++i) call(i);
      DSV4_CUDA_CHECK(cudaEventRecord(eb));
      DSV4_CUDA_CHECK(cudaEventSynchronize(eb));
      float ms = 0;
      DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, ea, eb));
      DSV4_CUDA_CHECK(cudaEventDestroy(ea));
      DSV4_CUDA_CHECK(cudaEventDestroy(eb));
      r.kernel += " back to back";
      r.us = 1000.0 * ms / kCalls;
      r.emit();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, prefill = true;
  std::string only;
  std::vector<int> batches{1, 2, 32, 64, 128, 256};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
      batches = {2, 128};
    } else if (std::strcmp(argv[i], "--no-prefill") == 0) {
      prefill = false;
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      only = argv[++i];
    } else if (std::strcmp(argv[i], "--batches") == 0 && i + 1 < argc) {
      batches.clear();
      for (const char* c = argv[++i]; *c != 0;) {
        char* end = nullptr;
        const long b = std::strtol(c, &end, 10);
        if (end == c || b < 1 || b > 4096) {
          std::fprintf(stderr, "--batches: expected a list like 8,32,64\n");
          return 2;
        }
        batches.push_back(int(b));
        c = *end == ',' ? end + 1 : end;
      }
    } else {
      std::fprintf(stderr,
                   "usage: sparse_attention_bench [--quick] [--no-prefill] [--batches 8,32,...] "
                   "[--only NAME]\n");
      return 2;
    }
  }
  std::mt19937 rng(7);
  const char* fm = "FlashMLA H200 side by side (anchors.md)";
  // The real heads and CSA top-k (real_config.h).
  const ModelConfig fc = bench::real_config("flash", false), pc = bench::real_config("pro", false);
  const int fh = fc.n_heads, ftopk = fc.index_topk, ph = pc.n_heads, ptopk = pc.index_topk;
  // FlashMLA decode, s_k = 16384, from anchors.md's side-by-side table (0 = not measured).
  struct Row {
    const char* name;
    int heads, ratio, topk, sq, hca_max;
    double b2, b64, b128, b256;
  };
  const Row rows[] = {
      {"flash_csa", fh, 4, ftopk, 1, 0, 23.5, 52.8, 54.5, 96.0},
      {"flash_csa", fh, 4, ftopk, 2, 0, 24.3, 52.8, 93.9, 175.0},
      {"flash_hca", fh, 128, 0, 1, 0, 20.5, 28.8, 30.7, 52.2},
      {"flash_hca", fh, 128, 0, 2, 0, 20.8, 29.9, 49.3, 87.5},
      {"flash_hca1024", fh, 128, 0, 1, 1024, 21.4, 49.7, 77.4, 118.4},
      {"flash_hca1024", fh, 128, 0, 2, 1024, 24.2, 73.3, 119.6, 196.0},
      {"pro_csa", ph, 4, ptopk, 1, 0, 0, 0, 0, 0},
      {"pro_csa", ph, 4, ptopk, 2, 0, 26.6, 112.3, 213.1, 415.9},
  };
  const auto pool_host = encoded_pool(rng);
  DeviceBuffer<uint8_t> pool(pool_host);
  for (const Row& row : rows)
    for (int b : batches) {
      if (!only.empty() && only != row.name) continue;
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
    if (!prefill) break;
    for (int pro = 0; pro < 2; ++pro) {
      const int heads = pro ? ph : fh, topk = pro ? ptopk : ftopk;
      const int64_t ctx = sq == 4096 ? 8192 : 16384;
      const double peer = sq == 4096 ? (pro ? 1947.0 : 634.0) : 0.0;
      if (!only.empty() && only != (pro ? "pro_csa_prefill" : "flash_csa_prefill")) continue;
      run({pro ? "pro_csa_prefill" : "flash_csa_prefill", heads, 4, topk, 1, sq, ctx, peer,
           peer > 0 ? fm : "", true},
          pool, rng);
      if (quick) break;
    }
  }
  return 0;
}
