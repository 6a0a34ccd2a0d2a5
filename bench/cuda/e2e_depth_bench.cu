// The engine's decode step and prefill on as many real-shape layers as fit one GPU (issue 14,
// point 1): V4-Flash or V4-Pro geometry, random weights generated on the GPU directly in the
// layouts the engine loads (FP8 linears with UE8M0 scales, routed experts in NVFP4 or MXFP4
// repacked tiles, BF16 / F32 tensors; no checkpoint, no host copy), every layer kind in its
// real proportion: the model's first N layers exactly as the real config has them (Flash:
// layers 0-1 SWA and 2 CSA hash-routed, then CSA / HCA alternating; Pro: 0-1 HCA and 2 CSA
// hash-routed, then HCA / CSA alternating) plus the MTP block. N: as many as fit (or --layers).
//
// Caches hold real data: for each context length one sequence is prefilled with random tokens
// (chunks of 8192), then its pages, window ring and compressor states are copied into every
// sequence of the batch (each sequence owns its pages: the batch reads B times the bytes).
// Decode steps run through CudaRunner::step as the engine loop does (CUDA graphs, device
// sampling, one synchronisation): batch 1, 8, 32, 128 at 4K and 64K contexts, each with greedy
// samples (the serving step) and with every row's logits downloaded. Per-layer times: CUDA
// events between the blocks inside the captured graph. Per-kernel times: one eager replay of
// the same step under CUPTI (bench/cuda/kernel_trace.h), each kernel's exclusive device time
// (its end minus the later of its start and every earlier kernel's end) attributed to its
// block, with the launches per layer. The MTP block: one eager forward per batch. The
// attribution checks itself (emit_kernels): per block, the eager launches against the graph's
// and the kernel time against the block's own event time; "trace check ... ok / FAILED" on
// stderr, e2e_depth_trace_check and e2e_depth_block_check lines, "check":0 on the rows of a
// kind that failed.
// Prefill: one sequence of 8192 tokens (eager, per-block events, one CUPTI replay).
//
// The full-depth step is EXTRAPOLATED, and every such row says so: the measured N-layer step
// + (real count - measured count) x the median measured time of each layer kind.
// Rooflines: bytes / 4.3 TB/s or FLOPs at FP8 1454 / BF16 749 TFLOPS, whichever is larger
// (../shared/spec/anchors.md), per layer from the config (weights, the experts the batch is
// expected to touch, the cache entries each query reads) and per op class.
//
// Usage: e2e_depth_bench [flash|pro] [nvfp4|mxfp4] [--layers N] [--quick] [--no-kernels]
//        [--batches 1,8,32,128] [--contexts 4096,65536] [--no-prefill] [--no-branches]
//        (--no-branches: CudaModelLimits::concurrent_branches off, the sub-layers' side
//        branches on the one stream)
//        [--moe-tiled auto|tiled|tiled256|ws128|ws256] (the expert GEMM kernel of the steps on the
//        tiled paths, i.e. the prefill: CudaModelLimits::moe_tiled_path / moe_tiled_tile;
//        tiled = the plain kernel's 128 tile, auto = the heuristic's pick)
//        [--dry-run FREE_GIB]  (no GPU: the layer mix, cache size and rooflines it would run)
// Output: JSON lines (stdout, and $DSV4_BENCH_OUT), progress on stderr; the markdown tables:
// scripts/e2e_depth_report.py.
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cuda/model.h"
#include "backends/cuda/runner.h"
#include "backends/cuda/weights.h"
#include "core/error.h"
#include "cuda/bench_util.h"
#include "cuda/depth_model.h"
#include "cuda/device_fill.cuh"
#include "cuda/kernel_trace.h"
#include "model/cache_spec.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/attn_output/attn_output.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/gemm/fp8_gemm.h"
#include "ops/cuda/gemm/w8a16_linear.h"
#include "ops/cuda/moe/fp4_pack.h"

namespace dsv4 {
namespace {

namespace cm = cuda::moe;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- random weights on the device -----------------------------------------------------------

__global__ void fp8_codes_kernel(uint8_t* p, size_t n, uint32_t seed) {
  // e4m3 codes in +-[0.5, 2) (exponent bits 0110 / 0111): no NaN, sane magnitudes.
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint8_t(0x30 | (bench::index_hash(i, seed) & 0x8f));
}
__global__ void bf16_mag_kernel(uint16_t* p, size_t n, uint32_t seed, uint32_t exp) {
  // sign and mantissa random, exponent fixed: +-[0.5, 1) * 2^(exp - 126).
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t r = bench::index_hash(i, seed);
    p[i] = uint16_t(((r >> 31) << 15) | (exp << 7) | (r & 0x7f));
  }
}
__global__ void f32_mag_kernel(float* p, size_t n, uint32_t seed, float offset, float mag) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = offset + mag * (float(bench::index_hash(i, seed) % 2001) / 1000.0f - 1.0f);
}
// Packed FP4 tiles (fp4_pack.h): [2048 code bytes][scale bytes] per 64x64 tile. Codes random
// (every bit pattern is a valid e2m1 set); scale bytes `scale_lo + hash % scale_span`.
__global__ void fp4_tiles_kernel(uint8_t* p, size_t n, uint32_t seed, int tile_bytes,
                                 uint32_t scale_lo, uint32_t scale_span) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = bench::index_hash(i, seed);
    const int t = int(i % size_t(tile_bytes));
    p[i] = t < cm::kPackCodeBytes ? uint8_t(h) : uint8_t(scale_lo + h % scale_span);
  }
}
// tid2eid [vocab, k]: k distinct experts per token.
__global__ void tid2eid_kernel(int32_t* p, int vocab, int k, int experts, uint32_t seed) {
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < vocab; t += gridDim.x * blockDim.x) {
    const uint32_t h = bench::index_hash(size_t(t), seed);
    const int step = experts / k;
    for (int j = 0; j < k; ++j) p[size_t(t) * k + j] = int32_t((h + uint32_t(j * step)) % experts);
  }
}
// Whole pages of a store copied: pairs[i] = (from page, to page), in words of type W.
template <typename W>
__global__ void copy_pages_kernel(uint8_t* base, int64_t page_bytes, const int2* pairs,
                                  int n_pairs) {
  const int64_t words = page_bytes / int64_t(sizeof(W));
  for (int pi = blockIdx.y; pi < n_pairs; pi += gridDim.y) {
    const int2 pr = pairs[pi];
    const W* src = reinterpret_cast<const W*>(base + pr.x * page_bytes);
    W* dst = reinterpret_cast<W*>(base + pr.y * page_bytes);
    for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words;
         w += int64_t(gridDim.x) * blockDim.x)
      dst[w] = src[w];
  }
}

class Gen {
 public:
  void fp8(uint8_t* p, size_t n) { fp8_codes_kernel<<<grid(n), 256>>>(p, n, next()); }
  void bf16(uint16_t* p, size_t n, double mag) {
    const uint32_t e = uint32_t(126 + std::lround(std::log2(std::max(mag, 1e-30))));
    bf16_mag_kernel<<<grid(n), 256>>>(p, n, next(), e);
  }
  void f32(float* p, size_t n, double mag, double offset = 0) {
    f32_mag_kernel<<<grid(n), 256>>>(p, n, next(), float(offset), float(mag));
  }
  void fp4(uint8_t* p, size_t n, int tile_bytes, uint32_t lo, uint32_t span) {
    fp4_tiles_kernel<<<grid(n), 256>>>(p, n, next(), tile_bytes, lo, span);
  }
  void tid2eid(int32_t* p, int vocab, int k, int experts) {
    tid2eid_kernel<<<grid(size_t(vocab)), 256>>>(p, vocab, k, experts, next());
  }
  static void check() { DSV4_CUDA_CHECK(cudaGetLastError()); }

 private:
  static unsigned grid(size_t n) {
    return unsigned(std::max<size_t>(1, std::min<size_t>(8192, (n + 255) / 256)));
  }
  uint32_t next() { return seed_ += 0x9e3779b9u; }
  uint32_t seed_ = 12345;
};

CudaBf16 bf16_tensor(Gen& g, size_t n, double mag) {
  CudaBf16 t{DeviceBuffer<uint16_t>(n)};
  g.bf16(t.bits.data(), n, mag);
  return t;
}
DeviceBuffer<float> f32_tensor(Gen& g, size_t n, double mag, double offset = 0) {
  DeviceBuffer<float> t(n);
  g.f32(t.data(), n, mag, offset);
  return t;
}
CudaHcUnit hc_unit(Gen& g, int rows, int width, int nscale) {
  return {f32_tensor(g, size_t(rows) * width, 1.0 / std::sqrt(double(width))),
          f32_tensor(g, size_t(rows), 0.5), f32_tensor(g, size_t(nscale), 0.2, 0.5)};
}

// An FP8 linear [n, k] as upload_cuda_weights builds it: e4m3 codes, UE8M0 scales of
// 1/sqrt(k), their fp32 transposed copy and the exact path's per-row BF16 scales.
CudaFp8Linear fp8_linear(Gen& g, int n, int k) {
  CudaFp8Linear l;
  l.n = n;
  l.k = k;
  l.codes = DeviceBuffer<uint8_t>(size_t(n) * k);
  g.fp8(l.codes.data(), l.codes.size());
  const int so = (n + 127) / 128, si = k / 128;
  DeviceBuffer<uint8_t> e8m0(size_t(so) * si);
  DSV4_CUDA_CHECK(
      cudaMemset(e8m0.data(), 127 - int(std::lround(0.5 * std::log2(double(k)))), e8m0.size()));
  l.scales_t = DeviceBuffer<float>(size_t(si) * so);
  cuda::fp8_weight_scales_to_f32(e8m0.data(), n, k, l.scales_t.data(), nullptr);
  if (n % 128 == 0) {
    l.scale_rows = DeviceBuffer<uint16_t>(cuda::w8a16_scale_rows_elems(n, k));
    cuda::w8a16_prepare_scales(e8m0.data(), n, k,
                               reinterpret_cast<__nv_bfloat16*>(l.scale_rows.data()), nullptr);
  }
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());  // e8m0 is read by the conversions above
  l.scale_e8m0 = std::move(e8m0);
  return l;
}

// One FP4 projection's scale bytes and epilogue for fan-in `in` (as fp4_pack.cpp derives them
// from a checkpoint whose scales are those bytes): weights ~ 1/sqrt(in) / 3 per e2m1 unit.
struct Fp4Gen {
  uint32_t lo = 0, span = 1;
  cm::Fp4Scale epi;
};
Fp4Gen fp4_gen(ExpertFormat f, int in) {
  Fp4Gen r;
  const double scale = 1.0 / std::sqrt(double(in)) / 3.0;
  if (f == ExpertFormat::kMxfp4) {
    const int s = 127 + int(std::lround(std::log2(scale)));
    const int lo = 128 - s, hi = 254 - s, c = std::max(lo, std::min(126, hi));
    r.lo = uint32_t(s);
    r.epi.bias = uint32_t(c) * 128u * 0x10001u;
    r.epi.mult = std::ldexp(1.0f, 126 - c);
  } else {
    // E4M3 block scales in [0.5, 2) (codes 0x30..0x3f) re-encoded u5m3: E' = e + 3 (9, 10).
    r.lo = 0x48;
    r.span = 16;
    r.epi.bias = cm::kNvScaleBias * 0x10001u;
    r.epi.mult = std::ldexp(float(scale), cm::kNvScaleShift);
  }
  return r;
}

cm::MoeDeviceWeights moe_weights(Gen& g, const ModelConfig& c, ExpertFormat f, bool hash) {
  cm::MoeDeviceWeights w;
  const int E = c.n_routed_experts, dim = c.dim, inter = c.moe_inter_dim;
  w.format = f;
  w.n_experts = E;
  w.dim = dim;
  w.inter = inter;
  const int tb = cm::pack_tile_bytes(f);
  w.w13_stride = size_t(2 * inter / cm::kPackRows) * (dim / cm::kPackK) * tb;
  w.w2_stride = size_t(dim / cm::kPackRows) * (inter / cm::kPackK) * tb;
  const Fp4Gen g13 = fp4_gen(f, dim), g2 = fp4_gen(f, inter);
  w.w13 = DeviceBuffer<uint8_t>(w.w13_stride * E);
  w.w2 = DeviceBuffer<uint8_t>(w.w2_stride * E);
  g.fp4(w.w13.data(), w.w13.size(), tb, g13.lo, g13.span);
  g.fp4(w.w2.data(), w.w2.size(), tb, g2.lo, g2.span);
  w.epi13 = DeviceBuffer<cm::Fp4Epilogue>(std::vector<cm::Fp4Epilogue>(E, {g13.epi, g13.epi}));
  w.epi2 = DeviceBuffer<cm::Fp4Epilogue>(std::vector<cm::Fp4Epilogue>(E, {g2.epi, g2.epi}));
  w.gate = DeviceBuffer<uint16_t>(size_t(E) * dim);
  g.bf16(w.gate.data(), w.gate.size(), 1.0 / std::sqrt(double(dim)));
  if (hash) {
    w.vocab = c.vocab_size;
    w.hash_top_k = c.n_activated_experts;
    w.tid2eid = DeviceBuffer<int32_t>(size_t(c.vocab_size) * c.n_activated_experts);
    g.tid2eid(w.tid2eid.data(), c.vocab_size, c.n_activated_experts, E);
  } else {
    w.bias = DeviceBuffer<float>(std::vector<float>(size_t(E), 0.0f));
  }
  return w;
}

CudaBlockWeights block_weights(Gen& g, const ModelConfig& c, int i, ExpertFormat f) {
  CudaBlockWeights b;
  const int dim = c.dim, hcd = c.hc_mult * c.dim, H = c.n_heads, D = c.head_dim;
  const int QL = c.q_lora_rank, G = c.o_groups, OL = c.o_lora_rank;
  b.index = i;
  b.ratio = c.ratio(i);
  b.hc_attn = hc_unit(g, c.mix_hc(), hcd, 3);
  b.hc_ffn = hc_unit(g, c.mix_hc(), hcd, 3);
  b.attn_norm = bf16_tensor(g, size_t(dim), 1.0);
  b.ffn_norm = bf16_tensor(g, size_t(dim), 1.0);
  b.heads = H;
  b.attn_heads = cuda_attention_heads(H);
  b.wq_a = fp8_linear(g, QL, dim);
  b.wq_b = fp8_linear(g, H * D, QL);
  b.wkv = fp8_linear(g, D, dim);
  b.wo_b = fp8_linear(g, dim, G * OL);
  b.q_norm = bf16_tensor(g, size_t(QL), 1.0);
  b.kv_norm = bf16_tensor(g, size_t(D), 1.0);
  b.sink = f32_tensor(g, size_t(b.attn_heads), 0.5);
  {  // wo_a: codes + UE8M0 scales + the tensor-core path's per-row scales
    const int in_g = c.heads_per_group() * D;
    b.wo_a.n = G * OL;
    b.wo_a.k = in_g;
    b.wo_a.codes = DeviceBuffer<uint8_t>(size_t(G) * OL * in_g);
    g.fp8(b.wo_a.codes.data(), b.wo_a.codes.size());
    b.wo_a.scale_e8m0 = DeviceBuffer<uint8_t>(size_t((G * OL + 127) / 128) * (in_g / 128));
    DSV4_CUDA_CHECK(cudaMemset(b.wo_a.scale_e8m0.data(),
                               127 - int(std::lround(0.5 * std::log2(double(in_g)))),
                               b.wo_a.scale_e8m0.size()));
    b.wo_a_scale_rows.bits = DeviceBuffer<uint16_t>(cuda::wo_a_scale_rows_elems(G, OL, in_g));
    cuda::wo_a_prepare_scales(b.wo_a.scale_e8m0.data(), G, OL, in_g,
                              reinterpret_cast<__nv_bfloat16*>(b.wo_a_scale_rows.bits.data()),
                              nullptr);
  }
  if (b.ratio > 0) {
    const int coff = b.ratio == 4 ? 2 : 1;
    b.main_width = coff * D;
    b.main_ape = f32_tensor(g, size_t(b.ratio) * coff * D, 0.5);
    b.main_norm = bf16_tensor(g, size_t(D), 1.0);
    if (b.ratio == 4) {
      const int DI = c.index_head_dim, HI = c.index_n_heads;
      b.index_width = 2 * DI;
      b.index_ape = f32_tensor(g, size_t(4) * 2 * DI, 0.5);
      b.index_norm = bf16_tensor(g, size_t(DI), 1.0);
      b.index_wq_b = fp8_linear(g, HI * DI, QL);
      b.weights_proj = bf16_tensor(g, size_t(HI) * dim, 1.0 / 64);
    }
    b.comp_rows = 2 * b.main_width + 2 * b.index_width;
    b.comp_proj = bf16_tensor(g, size_t(b.comp_rows) * dim, 1.0 / std::sqrt(double(dim)));
  }
  b.moe = moe_weights(g, c, f, c.is_hash_layer(i));
  b.shared_inter = c.moe_inter_dim;
  b.shared_fused = b.shared_inter % 128 == 0;
  if (b.shared_fused) {
    b.shared_w13 = fp8_linear(g, 2 * b.shared_inter, dim);
  } else {
    b.shared_w1 = fp8_linear(g, b.shared_inter, dim);
    b.shared_w3 = fp8_linear(g, b.shared_inter, dim);
  }
  b.shared_w2 = fp8_linear(g, dim, b.shared_inter);
  if (i >= c.n_layers) {  // the MTP block
    b.has_mtp = true;
    b.e_proj = fp8_linear(g, dim, dim);
    b.h_proj = fp8_linear(g, dim, dim);
    b.enorm = bf16_tensor(g, size_t(dim), 1.0);
    b.hnorm = bf16_tensor(g, size_t(dim), 1.0);
    b.mtp_norm = bf16_tensor(g, size_t(dim), 1.0);
    b.mtp_hc_head = hc_unit(g, c.hc_mult, hcd, 1);
  }
  Gen::check();
  return b;
}

size_t free_bytes() {
  size_t free = 0, total = 0;
  DSV4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

CudaModelWeights model_weights(const ModelConfig& c, ExpertFormat f) {
  check_cuda_supported(c);
  const size_t free0 = free_bytes();
  Gen g;
  CudaModelWeights m;
  m.embed = bf16_tensor(g, size_t(c.vocab_size) * c.dim, 1.0);
  m.head = bf16_tensor(g, size_t(c.vocab_size) * c.dim, 1.0 / std::sqrt(double(c.dim)));
  m.norm = bf16_tensor(g, size_t(c.dim), 1.0);
  m.hc_head = hc_unit(g, c.hc_mult, c.hc_mult * c.dim, 1);
  const cpu::RopeTable plain = cpu::RopeTable::make(c.rope_head_dim, c.rope_theta, 0, c.rope_factor,
                                                    c.beta_fast, c.beta_slow);
  const cpu::RopeTable yarn =
      cpu::RopeTable::make(c.rope_head_dim, c.compress_rope_theta, c.original_seq_len,
                           c.rope_factor, c.beta_fast, c.beta_slow);
  m.inv_freq_plain = DeviceBuffer<float>(plain.inv_freq);
  m.inv_freq_yarn = DeviceBuffer<float>(yarn.inv_freq);
  for (int i = 0; i < c.num_blocks(); ++i) m.blocks.push_back(block_weights(g, c, i, f));
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  m.device_bytes = free0 - free_bytes();
  return m;
}

using namespace depth;

// The op class of a traced kernel (by its demangled name). The project's two CUTLASS kernels
// are told apart by their mainloop (wo_a's mixed-input FP8 x BF16 one; both have e4m3 in their
// types); other GEMMs inside a layer are the compressor projections (with the indexer's
// weights_proj), counted with attention: bf16_stream_linear at m <= 8, else cuBLAS's (its nvjet
// and splitKreduce kernels, and the indexer's topk_cluster, fell into "other" until stop 31).
// CUTLASS's names can defeat the demangler and stay mangled
// ("_ZN7cutlass13device_kernel..."): the tests below match both spellings.
std::string op_class(const bench::TracedOp& op) {
  const std::string& n = op.demangled;
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (!op.kernel) return "copy";
  if (has("hc_cluster") || has("hc_split") || has("hc_post") || has("hc_pre") || has("mtp_combine"))
    return "mhc";
  if (has("stream_gemm") || has("w8a16")) return "fp8_gemm";
  if (has("cutlass") && has("device_kernel")) return has("MixedInput") ? "wo_a" : "fp8_gemm";
  if (has("wo_a")) return "wo_a";
  if (has("sparse_attn") || has("kv_entry") || has("kv_insert") || has("q_norm_rope") ||
      has("inverse_rope") || has("rope_table") || has("compressor") || has("indexer") ||
      has("bf16_stream_linear") || has("nvjet") || has("splitKreduce"))
    return "attention";
  if (has("router") || has("route_") || has("plan_kernel") || has("moe") || has("combine_kernel") ||
      has("swiglu"))
    return "moe";
  if (has("rms_norm") || has("quant")) return "norm_quant";
  if (has("embed") || has("gather_rows")) return "head";
  if (has("sample") || has("row_stats") || has("patch_kernel")) return "sampling";
  if (has("gemm") || has("xmma") || has("cutlass")) return "attention";  // cuBLAS in a layer
  return "other";
}

// ---- the run ----------------------------------------------------------------------------------

struct Options {
  std::string model = "flash", fmt = "nvfp4";
  int layers = 0;  // 0: as many as fit
  bool quick = false, kernels = true, prefill = true;
  bool branches = true;  // CudaModelLimits::concurrent_branches (--no-branches: off)
  // CudaModelLimits::moe_tiled_path / moe_tiled_tile (--moe-tiled tiled|tiled256|ws128|ws256).
  cuda::moe::MoeGemmPath moe_tiled_path = cuda::moe::MoeGemmPath::kTiled;
  int moe_tiled_tile = 0;
  double dry_run_gib = 0;  // > 0: no GPU; plan for this much free memory and print the rooflines
  std::vector<int> batches = {1, 8, 32, 128};
  std::vector<int64_t> contexts = {4096, 65536};
};

constexpr int kPrefillTokens = 8192;
constexpr int kMaxBatch = 128;

// Every sequence in `seqs` becomes a copy of `proto` (same length): its own compressed pages
// (already reserved, at least as many as proto's) get proto's bytes in every block, and its
// window ring and compressor states proto's.
void clone_sequences(CudaRunner& r, int proto, const std::vector<int>& seqs) {
  DeviceCache& dc = r.cache();
  const ModelConfig& c = r.config();
  const cudaStream_t stream = r.model().stream();
  const SequenceCache& P = r.sequence(proto);
  for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
    std::vector<int2> pairs;
    for (int id : seqs) {
      const SequenceCache& S = r.sequence(id);
      const auto& from = P.pages[int(k)];
      const auto& to = S.pages[int(k)];
      DSV4_CHECK(to.size() >= from.size(), "clone: ", to.size(), " pages reserved, ", from.size(),
                 " to copy");
      for (size_t i = 0; i < from.size(); ++i) pairs.push_back({from[i], to[i]});
    }
    if (pairs.empty()) continue;
    DeviceBuffer<int2> dpairs(pairs);
    for (int b = 0; b < c.num_blocks(); ++b) {
      if (c.ratio(b) == 0 || dc.compressed_kind(b) != k) continue;
      auto copy = [&](uint8_t* base, int64_t page_bytes) {
        const unsigned ny = unsigned(std::min<size_t>(pairs.size(), 65535));
        auto grid = [&](int64_t words) {
          return dim3(unsigned(std::min<int64_t>(64, (words + 255) / 256)), ny);
        };
        const bool a16 = page_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
        if (a16)
          copy_pages_kernel<uint4><<<grid(page_bytes / 16), 256, 0, stream>>>(
              base, page_bytes, dpairs.data(), int(pairs.size()));
        else
          copy_pages_kernel<uint8_t><<<grid(page_bytes), 256, 0, stream>>>(
              base, page_bytes, dpairs.data(), int(pairs.size()));
        DSV4_CUDA_CHECK(cudaGetLastError());
      };
      copy(dc.compressed_pages(b), dc.kv_page_bytes());
      if (c.ratio(b) == 4) copy(dc.index_pages(b), dc.index_page_bytes());
    }
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));  // dpairs dies here
  }
  for (int id : seqs) {
    SequenceCache& S = r.sequence(id);
    dc.copy_sequence(P, S, stream);
    S.tokens = P.tokens;
    S.mtp_tokens = P.mtp_tokens;
  }
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// What the trace's self-check compares each block against, per block ([n_layers] decoder
// blocks, then the head).
struct BlockRefs {
  std::vector<int> graph_launches;  // kernels + copies of the decode graph; empty: none (prefill)
  std::vector<double> graph_us;     // the graph's event time (median of the timed steps); empty
  std::vector<double> eager_us;     // the traced run's own event time
  bool forward_only = false;        // the region is one forward: nothing may fall outside a block
};

// Slack of "a block's exclusive kernel time <= its event time": both are read from the GPU's
// timer, the events at ~0.5 us resolution, CUPTI's start/end at its own; a few microseconds
// and 1 % cover the two readings of the same interval.
constexpr double kCheckSlackUs = 5.0, kCheckSlackRel = 1.01;

// Per-kernel rows of one traced forward: per layer kind, the kernel sequence of the kind's
// layers position by position (median exclusive time over the layers), launches per layer,
// and the time per op class beside the class's roofline. First the self-check of the
// attribution (stderr, and e2e_depth_block_check / e2e_depth_trace_check lines): the marker
// records found are the forward's n_layers + 2, every op has its launch record, in a forward
// replay no op falls outside the blocks, each block's eager launches equal the graph's, and
// each block's kernel time fits inside its own event time (ops of other blocks counted in
// would break it). Rows of a kind whose check failed carry "check":0.
void emit_kernels(const std::vector<bench::TracedOp>& ops, const bench::TraceStats& stats,
                  const BlockRefs& refs, const ModelConfig& c, ExpertFormat fmt,
                  const std::string& prefix, const std::string& what, int tokens, int64_t ctx,
                  const Extra& base_extra) {
  const int n_blocks = c.n_layers + 1;  // decoder blocks, then the head
  std::vector<std::vector<const bench::TracedOp*>> per_block(size_t(n_blocks) + 1);
  int before = 0, after = 0;
  for (const bench::TracedOp& op : ops) {
    if (op.block == -1) ++before;
    if (op.block >= n_blocks) ++after;
    const int b = op.block < 0 ? n_blocks : std::min(op.block, n_blocks);  // n_blocks: outside
    per_block[size_t(b)].push_back(&op);
  }
  auto kind_of_block = [&](int b) { return b < c.n_layers ? kind_of(c, b) : std::string("head"); };
  auto with_base = [&]() {
    Extra e;
    e.s << base_extra.str();
    e.first = base_extra.first;
    return e;
  };

  // ---- self-check -------------------------------------------------------------------------
  std::vector<int> launches_of(static_cast<size_t>(n_blocks));
  std::vector<double> ksum_of(static_cast<size_t>(n_blocks), 0.0);
  std::vector<bool> block_ok(static_cast<size_t>(n_blocks), true);
  double blocks_us = 0, total_us = 0, eager_total_us = 0;
  for (const bench::TracedOp& op : ops) total_us += op.excl_us;
  int launch_bad = 0, time_bad = 0;
  std::string first_bad;
  for (int b = 0; b < n_blocks; ++b) {
    const size_t i = size_t(b);
    launches_of[i] = int(per_block[i].size());
    for (const bench::TracedOp* op : per_block[i]) ksum_of[i] += op->excl_us;
    blocks_us += ksum_of[i];
    const int graph = i < refs.graph_launches.size() ? refs.graph_launches[i] : -1;
    const double eager = i < refs.eager_us.size() ? refs.eager_us[i] : -1;
    const double graph_us = i < refs.graph_us.size() ? refs.graph_us[i] : -1;
    if (eager > 0) eager_total_us += eager;
    const bool l_ok = graph < 0 || launches_of[i] == graph;
    const bool t_ok = eager < 0 || ksum_of[i] <= eager * kCheckSlackRel + kCheckSlackUs;
    launch_bad += !l_ok;
    time_bad += !t_ok;
    block_ok[i] = l_ok && t_ok;
    if (!block_ok[i] && first_bad.empty()) {
      char s[200];
      std::snprintf(s, sizeof s,
                    "block %d (%s): %d launches (graph %d), kernels %.1f us in %.1f us", b,
                    kind_of_block(b).c_str(), launches_of[i], graph, ksum_of[i], eager);
      first_bad = s;
    }
    char shape[320];
    std::snprintf(shape, sizeof shape, "%s block %d (%s) %s: eager launches and kernel time",
                  prefix.c_str(), b, kind_of_block(b).c_str(), what.c_str());
    Extra e = with_base();
    e.kv("kind", kind_of_block(b)).kv("block", double(b)).kv("launches", double(launches_of[i]));
    e.kv("graph_launches", double(graph)).kv("eager_us", eager).kv("graph_us", graph_us);
    e.kv("check", double(block_ok[i]));
    emit("e2e_depth_block_check", shape, ksum_of[i], Cost{}, e.str());
  }
  const int outside = int(per_block[size_t(n_blocks)].size());
  const bool markers_ok = stats.markers == c.n_layers + 2;
  const bool region_ok =
      markers_ok && stats.ops_no_launch == 0 && (!refs.forward_only || outside == 0);
  const bool all_ok = region_ok && launch_bad == 0 && time_bad == 0;
  {
    char shape[320];
    std::snprintf(shape, sizeof shape, "%s trace self-check %s", prefix.c_str(), what.c_str());
    Extra e = with_base();
    e.kv("markers", double(stats.markers)).kv("markers_expected", double(c.n_layers + 2));
    e.kv("foreign_event_records", double(stats.foreign_event_records));
    e.kv("ops", double(ops.size())).kv("ops_outside", double(outside));
    e.kv("ops_before", double(before)).kv("ops_after", double(after));
    e.kv("ops_no_launch", double(stats.ops_no_launch));
    e.kv("launch_mismatch_blocks", double(launch_bad)).kv("over_time_blocks", double(time_bad));
    e.kv("kernel_total_us", total_us).kv("eager_blocks_us", eager_total_us);
    e.kv("check", double(all_ok));
    emit("e2e_depth_trace_check", shape, blocks_us, Cost{}, e.str());
    std::fprintf(stderr,
                 "[%s] trace check %s: %s: %d/%d marker records (%d other cudaEventRecord "
                 "ignored), %zu ops, %d outside the blocks (%d before, %d after, %d without "
                 "launch record); kernels %.0f us in the blocks of %.0f us traced, block events "
                 "%.0f us; %d blocks' launches differ from the graph's, %d blocks' kernel time "
                 "exceeds their event time%s%s\n",
                 prefix.c_str(), what.c_str(), all_ok ? "ok" : "FAILED", stats.markers,
                 c.n_layers + 2, stats.foreign_event_records, ops.size(), outside, before, after,
                 stats.ops_no_launch, blocks_us, total_us, eager_total_us, launch_bad, time_bad,
                 first_bad.empty() ? "" : "; first: ", first_bad.c_str());
  }

  // ---- per kind ---------------------------------------------------------------------------
  std::map<std::string, std::vector<int>> blocks_of;
  for (int b = 0; b < c.n_layers; ++b) blocks_of[kind_of(c, b)].push_back(b);
  blocks_of["head"].push_back(c.n_layers);
  for (const auto& kind_blocks : blocks_of) {
    const std::string& kind = kind_blocks.first;
    const std::vector<int>& blocks = kind_blocks.second;
    const int ratio = kind == "head" ? -1 : c.ratio(blocks[0]);
    bool kind_ok = region_ok;
    for (int b : blocks) kind_ok = kind_ok && block_ok[size_t(b)];
    // Position-wise when every layer of the kind ran the same sequence, else by name.
    bool same = true;
    for (int b : blocks) {
      const auto& a = per_block[size_t(blocks[0])];
      const auto& x = per_block[size_t(b)];
      same &= a.size() == x.size();
      for (size_t i = 0; same && i < a.size(); ++i) same &= a[i]->full == x[i]->full;
    }
    std::vector<std::string> names, classes;
    std::vector<std::vector<double>> times;
    auto cls_of = [&](const bench::TracedOp& op) {
      const std::string k = op_class(op);
      return kind == "head" && k != "sampling" && k != "copy" ? std::string("head") : k;
    };
    if (same) {
      for (const bench::TracedOp* op : per_block[size_t(blocks[0])]) {
        names.push_back(op->full);
        classes.push_back(cls_of(*op));
      }
      times.resize(names.size());
      for (int b : blocks)
        for (size_t i = 0; i < names.size(); ++i)
          times[i].push_back(per_block[size_t(b)][i]->excl_us);
    } else {
      std::map<std::string, size_t> index;
      for (int b : blocks) {
        std::map<std::string, double> sum;
        std::map<std::string, std::string> cls;
        for (const bench::TracedOp* op : per_block[size_t(b)]) {
          sum[op->full] += op->excl_us;
          cls[op->full] = cls_of(*op);
        }
        for (const auto& [n, t] : sum) {
          if (!index.count(n)) {
            index[n] = names.size();
            names.push_back(n);
            classes.push_back(cls[n]);
            times.emplace_back();
          }
          times[index[n]].push_back(t);
        }
      }
    }
    std::vector<double> launches, graph_launches, graph_us, eager_us;
    for (int b : blocks) {
      const size_t i = size_t(b);
      launches.push_back(double(launches_of[i]));
      if (i < refs.graph_launches.size()) graph_launches.push_back(double(refs.graph_launches[i]));
      if (i < refs.graph_us.size()) graph_us.push_back(refs.graph_us[i]);
      if (i < refs.eager_us.size()) eager_us.push_back(refs.eager_us[i]);
    }
    std::map<std::string, double> by_class;
    double layer_us = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      const double us = median(times[i]);
      layer_us += us;
      by_class[classes[i]] += us;
      char shape[320];
      std::snprintf(shape, sizeof shape, "%s %s %s #%02zu %s", prefix.c_str(), kind.c_str(),
                    what.c_str(), i, names[i].c_str());
      Extra e = with_base();
      e.kv("kind", kind).kv("position", double(i)).kv("name", names[i]).kv("op", classes[i]);
      e.kv("layers_traced", double(blocks.size())).kv("check", double(kind_ok));
      emit("e2e_depth_kernel", shape, us, Cost{}, e.str());
    }
    const std::map<std::string, Cost> costs =
        ratio >= 0 ? layer_costs(c, ratio, fmt, tokens, ctx) : std::map<std::string, Cost>{};
    for (const char* cls : kOpClasses) {
      const auto it = by_class.find(cls);
      if (it == by_class.end()) continue;
      const auto ct = costs.find(cls);
      Cost k = ct != costs.end() ? ct->second : Cost{};
      if (kind == "head" && std::string(cls) == "head") k = head_cost(c, tokens);
      char shape[320];
      std::snprintf(shape, sizeof shape, "%s %s %s op %s", prefix.c_str(), kind.c_str(),
                    what.c_str(), cls);
      Extra e = with_base();
      e.kv("kind", kind).kv("op", cls).kv("check", double(kind_ok));
      emit("e2e_depth_op", shape, it->second, k, e.str());
    }
    char shape[320];
    std::snprintf(shape, sizeof shape, "%s %s %s launches and kernel time per layer",
                  prefix.c_str(), kind.c_str(), what.c_str());
    Extra e = with_base();
    e.kv("kind", kind).kv("launches", median(launches)).kv("kernel_sum_us", layer_us);
    if (!graph_launches.empty()) e.kv("graph_launches", median(graph_launches));
    if (!graph_us.empty()) e.kv("graph_us", median(graph_us));
    if (!eager_us.empty()) e.kv("eager_us", median(eager_us));
    e.kv("check", double(kind_ok));
    emit("e2e_depth_launches", shape, layer_us,
         ratio >= 0 ? layer_cost(c, ratio, fmt, tokens, ctx) : head_cost(c, tokens), e.str());
  }
  // What ran outside the blocks (the runner's metadata upload, sampling).
  if (!per_block[size_t(n_blocks)].empty()) {
    double us = 0;
    for (const bench::TracedOp* op : per_block[size_t(n_blocks)]) us += op->excl_us;
    char shape[320];
    std::snprintf(shape, sizeof shape, "%s outside the blocks %s (%zu ops)", prefix.c_str(),
                  what.c_str(), per_block[size_t(n_blocks)].size());
    emit("e2e_depth_outside", shape, us, Cost{}, base_extra.str());
  }
}

// Launches per block of one decode forward as a CUDA graph holds them (no CUPTI needed): the
// forward captured (block timing on: an event-record node before the embedding and after each
// block and the head), its nodes walked in capture order, kernels and copies counted between
// the event nodes. [n_layers] blocks, then the head.
std::vector<int> graph_launches(CudaModel& model, const DeviceStep& st, DeviceCache& cache) {
  const cudaStream_t s = model.stream();
  cudaGraph_t g = nullptr;
  DSV4_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  model.forward(st, cache);
  DSV4_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  size_t n = 0;
  DSV4_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  DSV4_CUDA_CHECK(cudaGraphGetNodes(g, nodes.data(), &n));
  const int blocks = model.config().n_layers + 1;
  std::vector<int> per(size_t(blocks), 0);
  int block = -1;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType t;
    DSV4_CUDA_CHECK(cudaGraphNodeGetType(node, &t));
    if (t == cudaGraphNodeTypeEventRecord) {
      ++block;
      continue;
    }
    if ((t == cudaGraphNodeTypeKernel || t == cudaGraphNodeTypeMemcpy ||
         t == cudaGraphNodeTypeMemset) &&
        block >= 0 && block < blocks)
      ++per[size_t(block)];
  }
  DSV4_CUDA_CHECK(cudaGraphDestroy(g));
  return per;
}

// $DSV4_DEPTH_TIMELINE, or null.
const char* timeline_path() {
  const char* tl = std::getenv("DSV4_DEPTH_TIMELINE");
  return tl && *tl ? tl : nullptr;
}

// Appends every traced op of a step to $DSV4_DEPTH_TIMELINE: block, stream, device start and end
// in µs from the step's first op, exclusive µs -- what overlaps what, which the per-kernel rows
// (exclusive times) do not show.
void dump_timeline(const std::vector<bench::TracedOp>& ops, const char* what, int batch,
                   int64_t ctx) {
  const char* tl = timeline_path();
  if (!tl || ops.empty()) return;
  FILE* f = std::fopen(tl, "a");
  if (!f) return;
  uint64_t t0 = ops.front().start;
  for (const auto& op : ops) t0 = std::min(t0, op.start);
  for (const auto& op : ops)
    std::fprintf(f, "%s b=%d ctx=%lld block %d stream %u %9.2f %9.2f excl %7.2f %s\n", what, batch,
                 (long long)ctx, op.block, op.stream, double(op.start - t0) / 1e3,
                 double(op.end - t0) / 1e3, op.excl_us, op.full.c_str());
  std::fclose(f);
}

struct Built {
  std::unique_ptr<DeviceContext> ctx;
  std::unique_ptr<CudaModel> model;
  std::unique_ptr<CudaRunner> runner;
  ModelConfig config;
  double weights_gib = 0, cache_gib = 0, act_gib = 0;
};

// The model with n layers, its activations for the largest step and the cache pool for
// kMaxBatch + 1 sequences of the longest context; throws on out-of-memory.
Built build(const Model& m, int n, ExpertFormat fmt, int64_t max_ctx, const Options& o) {
  Built b;
  b.config = config_with_layers(m, n);
  const ModelConfig& c = b.config;
  CudaModelWeights w = model_weights(c, fmt);
  b.weights_gib = double(w.device_bytes) / double(1ull << 30);
  CudaModelLimits lim;
  lim.max_tokens = kPrefillTokens;
  lim.max_seqs = kMaxBatch;
  lim.max_context = max_ctx + 256;
  lim.max_logit_rows = kMaxBatch;
  lim.concurrent_branches = o.branches;
  lim.moe_tiled_path = o.moe_tiled_path;
  lim.moe_tiled_tile = o.moe_tiled_tile;
  b.ctx = std::make_unique<DeviceContext>(0);
  b.model = std::make_unique<CudaModel>(*b.ctx, c, std::move(w), lim);
  b.act_gib = double(b.model->activation_bytes()) / double(1ull << 30);
  const CacheConfig cc = cache_capacity(c, kMaxBatch + 1, lim.max_context, 64);
  b.cache_gib = double(cache_bytes(c, cc)) / double(1ull << 30);
  CudaRunnerOptions graphs;
  graphs.cuda_graphs = true;
  b.runner = std::make_unique<CudaRunner>(*b.model, cc, graphs);
  // Room left for graphs, cuBLAS and CUPTI buffers.
  DSV4_CHECK(free_bytes() > (size_t(1) << 30), "less than 1 GiB left after the cache");
  return b;
}

// Bytes one more layer of this model takes (weights + cache at kMaxBatch+1 sequences), for
// the first guess of N.
double layer_gib(const Model& m, ExpertFormat fmt, int64_t max_ctx) {
  const ModelConfig c = config_with_layers(m, 5);
  const double bits = fmt == ExpertFormat::kMxfp4 ? 4.25 : 4.5;
  const double dim = c.dim, inter = c.moe_inter_dim;
  const double experts = double(c.n_routed_experts) * 3 * inter * dim * bits / 8;
  const double dense = c.q_lora_rank * dim + double(c.n_heads) * c.head_dim * c.q_lora_rank +
                       c.head_dim * dim + 2 * dim * c.o_groups * c.o_lora_rank + 3 * inter * dim +
                       double(c.index_n_heads) * c.index_head_dim * c.q_lora_rank;
  const CacheConfig cc = cache_capacity(c, kMaxBatch + 1, max_ctx + 256, 64);
  double cache = 0;
  for (int b = 3; b < 5; ++b) {  // one CSA and one HCA layer
    const CacheStoreBytes s = cache_store_bytes(c, cc, b);
    cache += double(s.window + s.compressed + s.index_keys + s.main_state + s.index_state) / 2;
  }
  return (experts + dense * 1.1 + cache) / double(1ull << 30);
}

void run(const Options& o) {
  const auto t_start = Clock::now();
  const bool nv = o.fmt == "nvfp4";
  const ExpertFormat fmt = nv ? ExpertFormat::kNvfp4 : ExpertFormat::kMxfp4;
  const Model m = o.model == "pro" ? pro_model(nv) : flash_model(nv);
  const int full_layers = int(m.real_ratios.size());
  // Every sequence's capacity: the longest decode context, and the prefill's 8192 tokens when
  // it runs (a 4K-only decode sweep used to fail at the prefill, after the decode cases).
  const int64_t max_ctx = std::max(*std::max_element(o.contexts.begin(), o.contexts.end()),
                                   o.prefill ? int64_t(kPrefillTokens) : int64_t(0));
  if (o.dry_run_gib <= 0) {
    DSV4_CUDA_CHECK(cudaSetDevice(0));
    DSV4_CUDA_CHECK(cudaFree(nullptr));
  }

  // N: the given count, or a first guess from the free memory, lowered by 2 (one CSA, one
  // HCA: the proportion stays the real prefix's) until the model, activations and cache fit.
  int n = o.layers;
  if (n <= 0) {
    const double free_gib =
        o.dry_run_gib > 0 ? o.dry_run_gib : double(free_bytes()) / double(1ull << 30);
    const double head_gib =
        2.0 * m.base.vocab_size * m.base.dim * 2 / double(1ull << 30);  // embed + head
    // The MTP block (a whole layer: 3.5 / 13.7 GiB), the activations of an 8K-token step
    // (~4 / ~8 GiB), graphs and workspaces.
    const double reserve_gib = o.model == "pro" ? 24.0 : 10.0;
    n = int((free_gib - head_gib - reserve_gib) / layer_gib(m, fmt, max_ctx));
    n = std::min(n, full_layers);
    if (n > 3 && n % 2 == 0) --n;  // odd: as many CSA as HCA after the 3 hash layers
    std::fprintf(stderr, "[%s %s] %.1f GiB free, ~%.2f GiB per layer: trying %d layers\n",
                 m.name.c_str(), o.fmt.c_str(), free_gib, layer_gib(m, fmt, max_ctx), n);
  }
  if (o.dry_run_gib > 0) {
    // The plan without a GPU: the layer mix, the cache and the rooflines of every case.
    const ModelConfig c = config_with_layers(m, n);
    check_cuda_supported(c);
    const std::map<std::string, int> measured = kind_counts(m, n),
                                     real = kind_counts(m, full_layers);
    for (const auto& [k, cnt] : measured)
      std::printf("kind %-9s measured %2d of %2d\n", k.c_str(), cnt, real.at(k));
    const CacheConfig cc = cache_capacity(c, kMaxBatch + 1, max_ctx + 256, 64);
    std::printf("cache %.2f GiB (%d sequences x %lld tokens)\n",
                double(cache_bytes(c, cc)) / double(1ull << 30), kMaxBatch + 1,
                (long long)(max_ctx + 256));
    auto step = [&](int layers, int tokens, int64_t ctx, int rows) {
      const ModelConfig cl = config_with_layers(m, layers);
      Cost k = head_cost(c, rows);
      for (int b = 0; b < layers; ++b) k += layer_cost(c, cl.ratio(b), fmt, tokens, ctx);
      return k;
    };
    for (int64_t ctx : o.contexts)
      for (int B : o.batches)
        std::printf("decode b=%3d ctx=%6lld: roofline %9.1f us (%d layers), %9.1f us (%d)\n", B,
                    (long long)ctx, step(n, B, ctx, B).bound_us(), n,
                    step(full_layers, B, ctx, B).bound_us(), full_layers);
    std::printf("prefill %d: roofline %.1f us (%d layers), %.1f us (%d)\n", kPrefillTokens,
                step(n, kPrefillTokens, 0, 1).bound_us(), n,
                step(full_layers, kPrefillTokens, 0, 1).bound_us(), full_layers);
    return;
  }
  Built B;
  for (;;) {
    DSV4_CHECK(n >= 1, "not even one layer fits");
    try {
      B = build(m, n, fmt, max_ctx, o);
      break;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[%s %s] %d layers do not fit (%s): trying %d\n", m.name.c_str(),
                   o.fmt.c_str(), n, e.what(), n - 2);
      B = Built{};
      cudaGetLastError();
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      if (o.layers > 0) throw;
      n -= 2;
    }
  }
  const ModelConfig& c = B.config;
  CudaModel& model = *B.model;
  CudaRunner& runner = *B.runner;
  const cudaStream_t stream = model.stream();
  const std::map<std::string, int> measured = kind_counts(m, n), real = kind_counts(m, full_layers);
  {
    std::string mix;
    for (const auto& [k, cnt] : measured)
      mix += k + " " + std::to_string(cnt) + "/" + std::to_string(real.at(k)) + ", ";
    std::fprintf(stderr,
                 "[%s %s] %d of %d layers + MTP (measured/real: %sMTP 1/1): weights %.1f GiB, "
                 "activations %.1f GiB, cache %.1f GiB (%d sequences x %lld tokens), %.1f GiB "
                 "free; built in %.1f s\n",
                 m.name.c_str(), o.fmt.c_str(), n, full_layers, mix.c_str(), B.weights_gib,
                 B.act_gib, B.cache_gib, kMaxBatch + 1, (long long)model.limits().max_context,
                 double(free_bytes()) / double(1ull << 30), seconds_since(t_start));
  }
  // A forced MoE kernel names itself in every row (the rows are not the default engine's).
  const std::string prefix =
      m.name + " " + o.fmt +
      (o.moe_tiled_path != cuda::moe::MoeGemmPath::kTiled || o.moe_tiled_tile != 0
           ? cat(" [moe ", cuda::moe::moe_gemm_path_name(o.moe_tiled_path), " tile ",
                 o.moe_tiled_tile, "]")
           : std::string());
  auto base_extra = [&](const std::string& phase, int batch, int64_t ctx) {
    Extra e;
    e.kv("model", m.name).kv("fmt", o.fmt).kv("phase", phase).kv("batch", double(batch));
    e.kv("ctx", double(ctx)).kv("layers", double(n)).kv("full_layers", double(full_layers));
    return e;
  };
  model.set_block_timing(true);  // events between the blocks, in every forward and graph
  std::mt19937 rng(7);
  auto random_tokens = [&](int count) {
    std::vector<int32_t> t(static_cast<size_t>(count));
    for (auto& x : t) x = int32_t(2 + rng() % uint32_t(c.vocab_size - 2));
    return t;
  };
  StepBuffers meta(step_limits(model.config(), model.limits(), runner.cache().config()),
                   c.window_size);
  bench::KernelTrace trace;
  trace.set_markers(model.block_events());  // only these records delimit the blocks
  const bool kernels = o.kernels && bench::KernelTrace::available();
  const int iters = o.quick ? 8 : 20;

  // Extrapolated step: measured + the missing layers of each kind at their median time.
  auto extrapolate = [&](double measured_us, const std::map<std::string, double>& kind_us) {
    double t = measured_us;
    for (const auto& [k, cnt] : real) {
      const int have = measured.count(k) ? measured.at(k) : 0;
      DSV4_CHECK(kind_us.count(k), "no measured layer of kind ", k);
      t += double(cnt - have) * kind_us.at(k);
    }
    return t;
  };
  auto step_cost = [&](int layers_of_model, int tokens, int64_t ctx, int rows) {
    const ModelConfig cc = config_with_layers(m, layers_of_model);
    Cost k = head_cost(c, rows);
    for (int b = 0; b < layers_of_model; ++b) k += layer_cost(c, cc.ratio(b), fmt, tokens, ctx);
    return k;
  };

  for (int64_t ctx : o.contexts) {
    // The prototype: ctx random tokens prefilled in chunks of kPrefillTokens.
    const auto t0 = Clock::now();
    const int proto = runner.open_sequence();
    for (int64_t done = 0; done < ctx;) {
      const int chunk = int(std::min<int64_t>(kPrefillTokens, ctx - done));
      StepInput in(proto, random_tokens(chunk));
      in.logits = false;
      runner.step({in});
      done += chunk;
    }
    std::fprintf(stderr, "[%s] prefilled the %lld-token prototype in %.1f s\n", prefix.c_str(),
                 (long long)ctx, seconds_since(t0));
    for (int Bn : o.batches) {
      const auto tc = Clock::now();
      std::vector<int> seqs;
      for (int i = 0; i < Bn; ++i) {
        seqs.push_back(runner.open_sequence());
        runner.sequence(seqs.back()).tokens = ctx;  // pages reserved by the first step
      }
      SamplingParams greedy;
      std::vector<SampleSpec> specs(static_cast<size_t>(Bn));
      for (SampleSpec& sp : specs) sp.params = &greedy;
      int nonfinite = 0;
      auto step = [&](bool sampled) {
        std::vector<StepInput> in;
        for (size_t i = 0; i < seqs.size(); ++i) {
          StepInput x(seqs[i], random_tokens(1));
          if (sampled) {
            x.logits = false;
            x.sample = &specs[i];
          }
          in.push_back(std::move(x));
        }
        const StepOutput out = runner.step(in);
        for (const std::string& e : out.errors) nonfinite += !e.empty();
      };
      step(true);  // eager (the graph's first sight): reserves every sequence's pages
      clone_sequences(runner, proto, seqs);
      step(true);  // captures the graph
      nonfinite = 0;
      auto timed = [&](bool sampled, std::vector<std::vector<float>>* blocks) {
        std::vector<double> us;
        for (int i = 0; i < 2; ++i) step(sampled);
        for (int i = 0; i < iters; ++i) {
          const auto a = Clock::now();
          step(sampled);
          us.push_back(seconds_since(a) * 1e6);
          if (blocks) blocks->push_back(model.block_times_ms());
        }
        return median(us);
      };
      std::vector<std::vector<float>> block_ms;
      const double sampled_us = timed(true, &block_ms);
      const double logits_us = timed(false, nullptr);
      // The timeline of one graph replay too ($DSV4_DEPTH_TIMELINE): what the step times run.
      // Graph kernels have no launch call of their own, so no block: "block -2" on every line.
      if (timeline_path() && kernels && trace.begin()) {
        step(true);
        DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
        dump_timeline(trace.end(), "graph", Bn, ctx);
      }

      // Per layer (graph events) and per kind.
      std::vector<double> layer_us(static_cast<size_t>(n));
      std::map<std::string, std::vector<double>> by_kind;
      for (int b = 0; b < n; ++b) {
        std::vector<double> v;
        for (const auto& t : block_ms) v.push_back(double(t[size_t(b)]) * 1000.0);
        layer_us[size_t(b)] = median(v);
        by_kind[kind_of(c, b)].push_back(layer_us[size_t(b)]);
      }
      std::vector<double> hv;
      for (const auto& t : block_ms) hv.push_back(double(t[size_t(n)]) * 1000.0);
      const double head_us = median(hv);
      Extra be = base_extra("decode", Bn, ctx);
      char shape[400];
      for (int b = 0; b < n; ++b) {
        std::snprintf(shape, sizeof shape, "%s layer %d (%s), decode b=%d ctx=%lld", prefix.c_str(),
                      b, kind_of(c, b).c_str(), Bn, (long long)ctx);
        Extra e = base_extra("decode", Bn, ctx);
        e.kv("kind", kind_of(c, b)).kv("block", double(b));
        emit("e2e_depth_layer", shape, layer_us[size_t(b)], layer_cost(c, c.ratio(b), fmt, Bn, ctx),
             e.str());
      }
      std::map<std::string, double> kind_us;
      for (const auto& [k, v] : by_kind) {
        kind_us[k] = median(v);
        int first = 0;
        while (kind_of(c, first) != k) ++first;
        std::snprintf(shape, sizeof shape,
                      "%s %s layer (median of %zu measured, %d in the real model), decode b=%d "
                      "ctx=%lld",
                      prefix.c_str(), k.c_str(), v.size(), real.at(k), Bn, (long long)ctx);
        Extra e = base_extra("decode", Bn, ctx);
        e.kv("kind", k).kv("measured_count", double(v.size())).kv("real_count", double(real.at(k)));
        emit("e2e_depth_kind", shape, kind_us[k], layer_cost(c, c.ratio(first), fmt, Bn, ctx),
             e.str());
      }
      std::snprintf(shape, sizeof shape, "%s head (hc_head, norm, logits), decode b=%d",
                    prefix.c_str(), Bn);
      emit("e2e_depth_head", shape, head_us, head_cost(c, Bn), be.str());
      const Cost part = step_cost(n, Bn, ctx, Bn);
      std::snprintf(shape, sizeof shape,
                    "%s %d-layer model (measured): engine decode step, greedy samples on the "
                    "device, b=%d ctx=%lld",
                    prefix.c_str(), n, Bn, (long long)ctx);
      {
        Extra e = base_extra("decode", Bn, ctx);
        e.kv("nonfinite_rows", double(nonfinite));
        emit("e2e_depth_step_sampled", shape, sampled_us, part, e.str());
      }
      std::snprintf(shape, sizeof shape,
                    "%s %d-layer model (measured): decode step with every row's logits "
                    "downloaded, b=%d ctx=%lld",
                    prefix.c_str(), n, Bn, (long long)ctx);
      emit("e2e_depth_step_logits", shape, logits_us, part, be.str());
      const double full = extrapolate(sampled_us, kind_us);
      std::snprintf(shape, sizeof shape,
                    "%s %d layers EXTRAPOLATED (measured %d-layer step + missing layers at "
                    "their kind's median), greedy samples, b=%d ctx=%lld, %.0f tokens/s",
                    prefix.c_str(), full_layers, n, Bn, (long long)ctx, Bn * 1e6 / full);
      emit("e2e_depth_step_extrapolated", shape, full, step_cost(full_layers, Bn, ctx, Bn),
           be.str());
      const double full_logits = extrapolate(logits_us, kind_us);
      std::snprintf(shape, sizeof shape,
                    "%s %d layers EXTRAPOLATED, every row's logits downloaded, b=%d ctx=%lld",
                    prefix.c_str(), full_layers, Bn, (long long)ctx);
      emit("e2e_depth_step_extrapolated_logits", shape, full_logits,
           step_cost(full_layers, Bn, ctx, Bn), be.str());
      if (nonfinite)
        std::fprintf(stderr, "[%s] WARNING: %d non-finite logits rows at b=%d ctx=%lld\n",
                     prefix.c_str(), nonfinite, Bn, (long long)ctx);

      // One eager replay of the step's forward (same positions: the sequences' last token),
      // traced; then the MTP block on its streams.
      {
        std::vector<std::vector<int32_t>> toks(static_cast<size_t>(Bn));
        std::vector<ChunkRef> chunks;
        std::vector<int> rows;
        for (int i = 0; i < Bn; ++i) {
          toks[size_t(i)] = random_tokens(1);
          SequenceCache& s = runner.sequence(seqs[size_t(i)]);
          chunks.push_back({&s, s.tokens - 1, toks[size_t(i)].data(), 1});
          rows.push_back(i);
        }
        const DeviceStep st = meta.build(chunks, rows, -1, stream);
        DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
        BlockRefs refs;
        refs.forward_only = true;
        refs.graph_us = layer_us;
        refs.graph_us.push_back(head_us);
        {
          const std::vector<int> per = graph_launches(model, st, runner.cache());
          refs.graph_launches = per;
          std::map<std::string, std::vector<double>> launches;
          for (int b = 0; b < n; ++b) launches[kind_of(c, b)].push_back(double(per[size_t(b)]));
          launches["head"].push_back(double(per[size_t(n)]));
          for (const auto& [k, v] : launches) {
            std::snprintf(shape, sizeof shape,
                          "%s %s launches per layer in the decode graph (kernels + copies), b=%d "
                          "ctx=%lld",
                          prefix.c_str(), k.c_str(), Bn, (long long)ctx);
            Extra e = base_extra("decode", Bn, ctx);
            e.kv("kind", k).kv("launches", median(v));
            emit("e2e_depth_graph_launches", shape, median(v), Cost{}, e.str());
          }
        }
        model.forward(st, runner.cache());  // warm (the eager path's own launch shapes)
        DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
        const bool traced = kernels && trace.begin();
        const auto a = Clock::now();
        model.forward(st, runner.cache());
        DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
        const double eager_us = seconds_since(a) * 1e6;
        const std::vector<bench::TracedOp> ops =
            traced ? trace.end() : std::vector<bench::TracedOp>{};
        for (float ms : model.block_times_ms()) refs.eager_us.push_back(double(ms) * 1000.0);
        std::snprintf(shape, sizeof shape, "%s %d-layer forward, eager (no graph)%s, b=%d ctx=%lld",
                      prefix.c_str(), n, traced ? ", traced" : "", Bn, (long long)ctx);
        emit("e2e_depth_forward_eager", shape, eager_us, part, be.str());
        if (traced) {
          dump_timeline(ops, "eager", Bn, ctx);
          char what[96];
          std::snprintf(what, sizeof what, "decode b=%d ctx=%lld", Bn, (long long)ctx);
          emit_kernels(ops, trace.stats(), refs, c, fmt, prefix, what, Bn, ctx, be);
        }
        // MTP: embedding, e/h projections, one SWA block, its head (eager, events).
        cudaEvent_t e0, e1;
        DSV4_CUDA_CHECK(cudaEventCreate(&e0));
        DSV4_CUDA_CHECK(cudaEventCreate(&e1));
        DeviceBuffer<uint16_t> hidden(size_t(Bn) * c.hc_mult * c.dim);
        DSV4_CUDA_CHECK(cudaMemcpyAsync(hidden.data(), model.hidden(), hidden.bytes(),
                                        cudaMemcpyDeviceToDevice, stream));
        const auto* h = reinterpret_cast<const __nv_bfloat16*>(hidden.data());
        model.mtp_forward(0, st, h, runner.cache());  // warm
        std::vector<double> mtp;
        for (int i = 0; i < 5; ++i) {
          DSV4_CUDA_CHECK(cudaEventRecord(e0, stream));
          model.mtp_forward(0, st, h, runner.cache());
          DSV4_CUDA_CHECK(cudaEventRecord(e1, stream));
          DSV4_CUDA_CHECK(cudaEventSynchronize(e1));
          float ms = 0;
          DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
          mtp.push_back(double(ms) * 1000.0);
        }
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        std::snprintf(shape, sizeof shape,
                      "%s MTP block (SWA, score-routed, + e/h projections and its head), eager, "
                      "b=%d ctx=%lld",
                      prefix.c_str(), Bn, (long long)ctx);
        Extra e = base_extra("decode", Bn, ctx);
        e.kv("kind", "MTP");
        emit("e2e_depth_mtp", shape, median(mtp), layer_cost(c, 0, fmt, Bn, ctx, true), e.str());
      }
      for (int id : seqs) runner.close_sequence(id);
      std::fprintf(stderr,
                   "[%s] b=%d ctx=%lld: step %.0f us sampled, %.0f us with logits (%.1f s)\n",
                   prefix.c_str(), Bn, (long long)ctx, sampled_us, logits_us, seconds_since(tc));
    }
    runner.close_sequence(proto);
  }

  // Prefill of kPrefillTokens tokens (one sequence from position 0), eager, per-block events.
  if (o.prefill) {
    const std::vector<int32_t> prompt = random_tokens(kPrefillTokens);
    std::vector<double> steps;
    std::vector<std::vector<float>> block_ms;
    std::vector<bench::TracedOp> ops;
    bench::TraceStats trace_stats;
    BlockRefs refs;  // no graph in prefill: the traced run's own events
    const int runs = o.quick ? 3 : 4;
    for (int i = 0; i < runs; ++i) {
      const int id = runner.open_sequence();
      StepInput in(id, prompt);
      in.logits = true;  // the last row's logits, as a prompt step returns
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      const bool traced = i == runs - 1 && kernels && trace.begin();
      const auto a = Clock::now();
      runner.step({in});
      const double us = seconds_since(a) * 1e6;
      if (traced) {
        DSV4_CUDA_CHECK(cudaDeviceSynchronize());
        ops = trace.end();
        trace_stats = trace.stats();
        for (float ms : model.block_times_ms()) refs.eager_us.push_back(double(ms) * 1000.0);
      }
      runner.close_sequence(id);
      if (i == 0 || traced) continue;  // warm-up; the traced run is not timed
      steps.push_back(us);
      block_ms.push_back(model.block_times_ms());
    }
    std::vector<double> layer_us(static_cast<size_t>(n));
    std::map<std::string, std::vector<double>> by_kind;
    Extra be = base_extra("prefill", kPrefillTokens, 0);
    char shape[400];
    for (int b = 0; b < n; ++b) {
      std::vector<double> v;
      for (const auto& t : block_ms) v.push_back(double(t[size_t(b)]) * 1000.0);
      layer_us[size_t(b)] = median(v);
      by_kind[kind_of(c, b)].push_back(layer_us[size_t(b)]);
      std::snprintf(shape, sizeof shape, "%s layer %d (%s), prefill %d tokens", prefix.c_str(), b,
                    kind_of(c, b).c_str(), kPrefillTokens);
      Extra e = base_extra("prefill", kPrefillTokens, 0);
      e.kv("kind", kind_of(c, b)).kv("block", double(b));
      emit("e2e_depth_prefill_layer", shape, layer_us[size_t(b)],
           layer_cost(c, c.ratio(b), fmt, kPrefillTokens, 0), e.str());
    }
    std::map<std::string, double> kind_us;
    for (const auto& [k, v] : by_kind) {
      kind_us[k] = median(v);
      int first = 0;
      while (kind_of(c, first) != k) ++first;
      std::snprintf(shape, sizeof shape,
                    "%s %s layer (median of %zu measured, %d in the real model), prefill %d tokens",
                    prefix.c_str(), k.c_str(), v.size(), real.at(k), kPrefillTokens);
      Extra e = base_extra("prefill", kPrefillTokens, 0);
      e.kv("kind", k).kv("measured_count", double(v.size())).kv("real_count", double(real.at(k)));
      emit("e2e_depth_prefill_kind", shape, kind_us[k],
           layer_cost(c, c.ratio(first), fmt, kPrefillTokens, 0), e.str());
    }
    const double measured_us = median(steps);
    std::snprintf(shape, sizeof shape, "%s %d-layer model (measured): prefill step of %d tokens",
                  prefix.c_str(), n, kPrefillTokens);
    emit("e2e_depth_prefill_step", shape, measured_us, step_cost(n, kPrefillTokens, 0, 1),
         be.str());
    const double full = extrapolate(measured_us, kind_us);
    std::snprintf(shape, sizeof shape,
                  "%s %d layers EXTRAPOLATED (measured %d-layer step + missing layers at their "
                  "kind's median), prefill %d tokens, %.0f tokens/s",
                  prefix.c_str(), full_layers, n, kPrefillTokens, kPrefillTokens * 1e6 / full);
    emit("e2e_depth_prefill_extrapolated", shape, full,
         step_cost(full_layers, kPrefillTokens, 0, 1), be.str());
    if (!ops.empty()) {
      char what[64];
      std::snprintf(what, sizeof what, "prefill %d", kPrefillTokens);
      emit_kernels(ops, trace_stats, refs, c, fmt, prefix, what, kPrefillTokens, 0, be);
    }
  }
  // (Block timing stays on: the runner's graphs hold its events and are destroyed first.)
  std::fprintf(stderr, "[%s] done in %.1f s\n", prefix.c_str(), seconds_since(t_start));
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

}  // namespace
}  // namespace dsv4

int main(int argc, char** argv) {
  using namespace dsv4;
  Options o;
  const char* usage =
      "usage: e2e_depth_bench [flash|pro] [nvfp4|mxfp4] [--layers N] [--quick] [--no-kernels] "
      "[--no-prefill] [--no-branches] [--moe-tiled auto|tiled|tiled256|ws128|ws256] "
      "[--batches 1,8,32,128] [--contexts 4096,65536] "
      "[--dry-run FREE_GIB]\n";
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw Error(cat(a, " needs a value"));
        return argv[++i];
      };
      if (a == "flash" || a == "pro")
        o.model = a;
      else if (a == "nvfp4" || a == "mxfp4")
        o.fmt = a;
      else if (a == "--layers") {
        o.layers = std::stoi(value());
        // Layers 0-4 hold every kind (the extrapolation needs one of each).
        if (o.layers < 5) throw Error(cat("--layers ", o.layers, ": at least 5"));
      } else if (a == "--quick")
        o.quick = true;
      else if (a == "--no-kernels")
        o.kernels = false;
      else if (a == "--dry-run")
        o.dry_run_gib = std::stod(value());
      else if (a == "--no-prefill")
        o.prefill = false;
      else if (a == "--no-branches")
        o.branches = false;
      else if (a == "--moe-tiled") {
        const std::string v = value();
        using P = cuda::moe::MoeGemmPath;
        if (v == "auto")
          o.moe_tiled_path = P::kTiled, o.moe_tiled_tile = 0;
        else if (v == "tiled")
          o.moe_tiled_path = P::kTiled, o.moe_tiled_tile = 128;
        else if (v == "tiled256")
          o.moe_tiled_path = P::kTiled, o.moe_tiled_tile = 256;
        else if (v == "ws128")
          o.moe_tiled_path = P::kTiledWs, o.moe_tiled_tile = 128;
        else if (v == "ws256")
          o.moe_tiled_path = P::kTiledWs, o.moe_tiled_tile = 256;
        else
          throw Error(cat("--moe-tiled ", v, ": auto, tiled, tiled256, ws128 or ws256"));
      } else if (a == "--batches") {
        o.batches.clear();
        for (int64_t b : parse_list(value())) o.batches.push_back(int(b));
      } else if (a == "--contexts")
        o.contexts = parse_list(value());
      else {
        std::fprintf(stderr, "%s", usage);
        return 2;
      }
    }
    for (int b : o.batches)
      if (b < 1 || b > kMaxBatch) throw Error(cat("batch ", b, " outside [1, ", kMaxBatch, "]"));
    for (int64_t x : o.contexts)
      if (x < 1 || x > (int64_t(1) << 20)) throw Error(cat("context ", x, " out of range"));
    if (o.contexts.empty() || o.batches.empty()) throw Error("no batches or contexts");
    run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "e2e_depth_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
