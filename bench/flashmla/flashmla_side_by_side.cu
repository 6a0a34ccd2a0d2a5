// Our sparse decode against FlashMLA's sm90 sparse FP8 decode (issue 17, deliverable 6), in one
// process on one H200: both read the very same cache pages (FlashMLA's "MODEL1" page is our
// 584-byte page byte for byte), ours through block tables and top-k entry indices, FlashMLA
// through the equivalent absolute slot indices (page x 64 + slot; -1 invalid), the window as
// its main cache (128 indices per query) and the compressed store as its extra cache. Same
// timer for both: CUDA events around one call, inputs rotated past L2 (bench::median_us);
// FlashMLA's time is its decode kernel plus its combine (the scheduler metadata, which its API
// caches, is computed once outside the timing). Every window entry is read from the ring on
// both sides (no staged entries), the sinks are the same. HCA rows pass each sequence's entry
// count as FlashMLA's extra_topk_length.
//
// Built only with -DDSV4_FLASHMLA_DIR (a FlashMLA copy, never committed) and
// -DDSV4_FLASHMLA_LIB (its sm90 sources compiled by scripts/flashmla/run.sh); one JSON line
// per shape, ours as `us`, FlashMLA's as `peer_us`, and the relative L2 between the outputs.
//
// Usage: flashmla_side_by_side [--quick] [--kernel auto|mma|wgmma]
//   --kernel: ours through the planner's choice (auto, the default) or that kernel forced, the
//   planner choosing heads per CTA and splits around it (the shape names the plan).
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "bench_util.h"
#include "core/formats.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/sparse_attention/sparse_attention.h"
#include "sparse_attention_inputs.cuh"

// FlashMLA's launchers (csrc/ of its copy).
#include "params.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

using namespace dsv4;
using namespace dsv4::cuda;
using namespace dsv4::bench::sparse_attn;

namespace {

constexpr float kLog2e = 1.4426950408889634f;
SparseAttnKernel g_kernel = SparseAttnKernel::kAuto;  // --kernel

int round_up64(int v) {
  return (v + 63) / 64 * 64;
}

// FlashMLA's absolute slot indices for copy c: window [T, 128] and extra [T, extra_topk].
void flashmla_indices(const Inputs& in, int c, int extra_topk, std::vector<int32_t>& win,
                      std::vector<int32_t>& extra) {
  win.assign(size_t(in.T) * kWindow, -1);
  extra.assign(size_t(in.T) * std::max(extra_topk, 1), -1);
  for (int t = 0; t < in.T; ++t) {
    const int s = t / in.sh.sq;
    const int64_t p = in.position(t);
    for (int i = 0; i < kWindow; ++i) {
      const int64_t j = std::max<int64_t>(0, p - kWindow + 1) + i;
      if (j > p) break;
      const int64_t e = j % kWindow;
      win[size_t(t) * kWindow + i] = in.wt[c][s * in.win_pages + e / kPage] * kPage + e % kPage;
    }
    auto comp_slot = [&](int64_t v) {
      return in.ct[c][s * in.comp_pages + v / kPage] * kPage + int32_t(v % kPage);
    };
    if (in.sh.ratio == 4)
      for (int r = 0; r < in.K; ++r) {
        const int32_t v = in.idx[size_t(t) * in.K + r];
        if (v >= 0 && v < (p + 1) / 4) extra[size_t(t) * extra_topk + r] = comp_slot(v);
      }
    if (in.sh.ratio == 128)
      for (int64_t v = 0; v < (p + 1) / 128; ++v) extra[size_t(t) * extra_topk + v] = comp_slot(v);
  }
}

template <int H>
void run_flashmla(const SparseAttnDecodeParams& p) {
  sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, H>(p);
}

void run(const Shape& shape, const DeviceBuffer<uint8_t>& pool, std::mt19937& rng) {
  Shape sh = shape;
  sh.staged = false;
  Inputs in(sh, pool, rng);
  const int T = in.T, H = in.H, sq = sh.sq, b = sh.b;
  const int sms = cuda::sm_count();

  // Ours: the planner's choice.
  SparseAttnParams p = in.params(0);
  p.kernel = g_kernel;
  DeviceBuffer<uint8_t> ws(sparse_attention_workspace_bytes(p));
  p.workspace = ws.data();
  p.workspace_bytes = ws.size();
  const SparseAttnPlan plan = sparse_attention_plan(p);
  auto ours = [&](int c) {
    SparseAttnParams pc = in.params(c);
    pc.kernel = g_kernel;
    pc.workspace = ws.data();
    pc.workspace_bytes = ws.size();
    sparse_attention(pc, nullptr);
  };

  // FlashMLA: indices per copy, scheduler metadata once, split scratch as its API sizes it.
  const int extra_topk = sh.ratio == 4
                             ? round_up64(in.K)
                             : round_up64(int(std::max<int64_t>(1, (in.max_pos + 1) / 128)));
  std::vector<DeviceBuffer<int32_t>> d_win, d_extra;
  for (int c = 0; c < in.copies; ++c) {
    std::vector<int32_t> w, e;
    flashmla_indices(in, c, extra_topk, w, e);
    d_win.emplace_back(w);
    d_extra.emplace_back(e);
  }
  // HCA: each sequence's entry count as FlashMLA's extra_topk_length (its own test's "<= 1024
  // entries" rows do the same), so it skips the -1 padding past a sequence's entries as we do.
  std::vector<int32_t> extra_len(b);
  for (int s = 0; s < b; ++s) extra_len[s] = int32_t((in.position(s * sq + sq - 1) + 1) / 128);
  DeviceBuffer<int32_t> d_extra_len(extra_len);
  int32_t* extra_len_ptr = sh.ratio == 128 ? d_extra_len.data() : nullptr;
  const int num_sm_parts = std::max(sms / sq / (H / 64), 1);
  DeviceBuffer<int32_t> sched(size_t(num_sm_parts) * (sizeof(DecodingSchedMeta) / 4));
  DeviceBuffer<int32_t> num_splits(size_t(b) + 1);
  {
    GetDecodeSchedMetaParams m{};
    m.b = b;
    m.s_q = sq;
    m.block_size_n = 64;
    m.fixed_overhead_num_blocks = 5;
    m.topk = kWindow;
    m.extra_topk = extra_topk;
    m.topk_length = nullptr;
    m.extra_topk_length = extra_len_ptr;
    m.seqlens_k_ptr = nullptr;
    m.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(sched.data());
    m.num_splits_ptr = num_splits.data();
    m.num_sm_parts = num_sm_parts;
    m.stream = nullptr;
    smxx::decode::run_get_decoding_sched_meta_kernel(m);
    DSV4_CUDA_CHECK(cudaGetLastError());
  }
  const int total_splits = b + num_sm_parts;
  DeviceBuffer<float> lse(size_t(T) * H), lse_accum(size_t(total_splits) * sq * H);
  DeviceBuffer<float> o_accum(size_t(total_splits) * sq * H * 512);
  DeviceBuffer<uint16_t> fm_out(size_t(T) * H * 512);
  const int64_t total_pages = int64_t(in.pages.size() / in.page_bytes);

  SparseAttnDecodeParams fp{};
  fp.b = b;
  fp.s_q = sq;
  fp.h_q = H;
  fp.h_kv = 1;
  fp.d_qk = 512;
  fp.d_v = 512;
  fp.sm_scale = 1.0f / std::sqrt(512.0f);
  fp.sm_scale_div_log2 = fp.sm_scale * kLog2e;
  fp.num_blocks = int(total_pages);
  fp.page_block_size = kPage;
  fp.topk = kWindow;
  fp.model_type = ModelType::MODEL1;
  fp.q = reinterpret_cast<cutlass::bfloat16_t*>(in.q.data());
  fp.kv = reinterpret_cast<cutlass::bfloat16_t*>(in.pages.data());
  fp.topk_length = nullptr;
  fp.attn_sink = in.d_sink.data();
  fp.lse = lse.data();
  fp.out = reinterpret_cast<cutlass::bfloat16_t*>(fm_out.data());
  fp.extra_num_blocks = int(total_pages);
  fp.extra_page_block_size = kPage;
  fp.extra_topk = extra_topk;
  fp.extra_kv = fp.kv;
  fp.extra_topk_length = extra_len_ptr;
  fp.stride_q_b = sq * H * 512;
  fp.stride_q_s_q = H * 512;
  fp.stride_q_h_q = 512;
  fp.stride_kv_block = int(in.page_bytes);
  fp.stride_kv_row = 584;
  fp.stride_indices_b = sq * kWindow;
  fp.stride_indices_s_q = kWindow;
  fp.stride_lse_b = sq * H;
  fp.stride_lse_s_q = H;
  fp.stride_o_b = sq * H * 512;
  fp.stride_o_s_q = H * 512;
  fp.stride_o_h_q = 512;
  fp.stride_extra_kv_block = int(in.page_bytes);
  fp.stride_extra_kv_row = 584;
  fp.stride_extra_indices_b = sq * extra_topk;
  fp.stride_extra_indices_s_q = extra_topk;
  fp.stream = nullptr;
  fp.lse_accum = lse_accum.data();
  fp.o_accum = o_accum.data();
  fp.stride_lse_accum_split = sq * H;
  fp.stride_lse_accum_s_q = H;
  fp.stride_o_accum_split = sq * H * 512;
  fp.stride_o_accum_s_q = H * 512;
  fp.stride_o_accum_h_q = 512;
  fp.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(sched.data());
  fp.num_splits_ptr = num_splits.data();
  fp.num_sm_parts = num_sm_parts;

  CombineParams cp{};
  cp.b = b;
  cp.s_q = sq;
  cp.h_q = H;
  cp.d_v = 512;
  cp.lse = fp.lse;
  cp.out = fp.out;
  cp.stride_lse_b = fp.stride_lse_b;
  cp.stride_lse_s_q = fp.stride_lse_s_q;
  cp.stride_o_b = fp.stride_o_b;
  cp.stride_o_s_q = fp.stride_o_s_q;
  cp.stride_o_h_q = fp.stride_o_h_q;
  cp.lse_accum = fp.lse_accum;
  cp.o_accum = fp.o_accum;
  cp.stride_lse_accum_split = fp.stride_lse_accum_split;
  cp.stride_lse_accum_s_q = fp.stride_lse_accum_s_q;
  cp.stride_o_accum_split = fp.stride_o_accum_split;
  cp.stride_o_accum_s_q = fp.stride_o_accum_s_q;
  cp.stride_o_accum_h_q = fp.stride_o_accum_h_q;
  cp.tile_scheduler_metadata_ptr = fp.tile_scheduler_metadata_ptr;
  cp.num_splits_ptr = fp.num_splits_ptr;
  cp.num_sm_parts = num_sm_parts;
  cp.attn_sink = fp.attn_sink;
  cp.stream = nullptr;

  auto flashmla = [&](int c) {
    SparseAttnDecodeParams pc = fp;
    pc.indices = d_win[c].data();
    pc.extra_indices = d_extra[c].data();
    if (H == 64)
      run_flashmla<64>(pc);
    else
      run_flashmla<128>(pc);
    smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(cp);
  };

  // Outputs on copy 0, then the timings.
  in.out.fill_bytes(0xff);
  fm_out.fill_bytes(0xff);
  ours(0);
  flashmla(0);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto a = in.out.download(), f = fm_out.download();
  double num = 0, den = 0;
  int64_t nan = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_float(a[i]), y = bf16_to_float(f[i]);
    if (std::isnan(x) || std::isnan(y)) {
      ++nan;
      continue;
    }
    num += (x - y) * (x - y);
    den += y * y;
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  const double us_ours = bench::median_us([&](int i) { ours(i % in.copies); }, 100);
  const double us_fm = bench::median_us([&](int i) { flashmla(i % in.copies); }, 100);

  bench::Result r;
  r.kernel = "sparse_decode_vs_flashmla";
  char name[256];
  std::snprintf(name, sizeof name,
                "%s h%d b=%d sq=%d keys/q=%.0f [ours %s ht %d splits %d; rel L2 %.1e, %lld NaN]",
                sh.name.c_str(), H, b, sq, in.keys / T,
                plan.kernel == SparseAttnKernel::kWgmma           ? "wgmma"
                : plan.kernel == SparseAttnKernel::kWgmmaDirect   ? "wgmma_direct"
                : plan.kernel == SparseAttnKernel::kWgmmaUnpaired ? "wgmma_unpaired"
                                                                  : "mma",
                plan.heads_per_cta, plan.num_splits, rel, (long long)nan);
  r.shape = name;
  r.us = us_ours;
  r.flops = 2.0 * H * in.keys * 1024.0;
  r.bytes = in.keys * 584 + 2.0 * double(T) * H * 512 * 2;
  r.peer = "FlashMLA sm90 sparse FP8 decode, same run";
  r.peer_us = us_fm;
  r.emit();
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--kernel") == 0 && i + 1 < argc) {
      const char* k = argv[++i];
      if (std::strcmp(k, "auto") == 0) {
        g_kernel = SparseAttnKernel::kAuto;
      } else if (std::strcmp(k, "mma") == 0) {
        g_kernel = SparseAttnKernel::kMma;
      } else if (std::strcmp(k, "wgmma") == 0) {
        g_kernel = SparseAttnKernel::kWgmma;
      } else if (std::strcmp(k, "wgmma_direct") == 0) {
        g_kernel = SparseAttnKernel::kWgmmaDirect;
      } else if (std::strcmp(k, "wgmma_unpaired") == 0) {
        g_kernel = SparseAttnKernel::kWgmmaUnpaired;
      } else {
        std::fprintf(stderr,
                     "--kernel %s: expected auto, mma, wgmma, wgmma_direct or wgmma_unpaired\n", k);
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--kernel auto|mma|wgmma|wgmma_direct|wgmma_unpaired]\n",
                   argv[0]);
      return 2;
    }
  }
  std::mt19937 rng(7);
  struct Row {
    const char* name;
    int heads, ratio, topk, sq, hca_max;
  };
  // Issue 17's table, at 16384 tokens of context (HCA <= 1024: U[1, 1024] entries).
  const Row rows[] = {
      {"flash_csa", 64, 4, 512, 1, 0},        {"flash_csa", 64, 4, 512, 2, 0},
      {"flash_hca", 64, 128, 0, 1, 0},        {"flash_hca", 64, 128, 0, 2, 0},
      {"flash_hca1024", 64, 128, 0, 1, 1024}, {"flash_hca1024", 64, 128, 0, 2, 1024},
      {"pro_csa", 128, 4, 1024, 1, 0},        {"pro_csa", 128, 4, 1024, 2, 0},
  };
  const auto pool_host = encoded_pool(rng);
  DeviceBuffer<uint8_t> pool(pool_host);
  for (const Row& row : rows)
    for (int b : {2, 64, 128, 256}) {
      if (quick && b != 2 && b != 128) continue;
      Shape sh{row.name, row.heads, row.ratio, row.topk, b, row.sq, 16384, 0.0, ""};
      sh.hca_max_entries = row.hca_max;
      run(sh, pool, rng);
    }
  return 0;
}
