// End-to-end benchmark of the CUDA engine at the real model shapes: V4-Flash (and V4-Pro)
// geometry with random weights in NVFP4 or MXFP4, decode steps at batch 1, 8, 32, 128 with 4K
// and 64K contexts (CUDA graphs, as the engine runs them), and a prefill of 8K tokens.
//
// Not the whole model: one block of each attention kind (Flash: SWA, CSA, HCA; Pro: CSA, HCA),
// plus the embedding and the head. Each block is timed alone (CUDA events around it inside the
// captured step), and the full model's step is EXTRAPOLATED from those per-layer times: Flash
// = 2 SWA + 21 CSA + 20 HCA blocks + head (43 layers), Pro = 30 CSA + 31 HCA + head (61).
// Each result line says so ("extrapolated"). The caches of the batch's sequences are filled
// with a constant, finite FP8 pattern for the context length (the values do not change what a
// step reads), so a 64K context costs no 64K-token prefill.
//
// Beside each time: the roofline, max(bytes / 4.3 TB/s, FLOPs at the measured tensor rates:
// FP8 1454, BF16 749 TFLOPS). Bytes of a decode step per layer = every dense weight (FP8/BF16)
// + the routed experts the batch is expected to touch (E (1 - (1 - k/E)^B), 4.25 bits per
// weight MXFP4 / 4.5 NVFP4) + the cache entries the batch reads (window 128 + top-k or all
// compressed entries, indexer keys of the whole context on CSA layers, 584 / 68 bytes each).
// FLOPs: dense GEMMs at the FP8 rate, expert GEMMs (W4A16) and attention/indexer at BF16.
//
// Usage: e2e_decode_bench [flash|pro] [nvfp4|mxfp4] [--quick] [--exact-linears] [--speculative]
//        (default: flash nvfp4, FP8 linears on FP8 tensor cores; --speculative: the verify
//        step of speculative decoding against the plain step, run_speculative below)
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/model.h"
#include "backends/cuda/runner.h"
#include "backends/cuda/weights.h"
#include "core/error.h"
#include "cuda/bench_util.h"
#include "cuda/real_config.h"
#include "model/cache_spec.h"
#include "model/weights.h"
#include "ops/cuda/common/cuda_check.h"
#include "support/host_tensors.h"

namespace dsv4 {
namespace {

// ---- random weights in host memory ----------------------------------------------------------

// Tensors with random contents of sane magnitude (weights ~ 1/sqrt(fan_in), so activations
// stay O(1) and the router spreads tokens over the experts). All routed experts of a layer
// share one host copy (the device still gets E separately repacked copies).
class RandomWeights {
 public:
  explicit RandomWeights(uint64_t seed) : rng_(seed) {}

  const TensorView* bf16(const std::string& n, std::vector<int64_t> shape, double mag) {
    const int64_t count = numel(shape);
    std::vector<uint8_t> b(size_t(count) * 2);
    const int e = 126 + int(std::lround(std::log2(std::max(mag, 1e-30))));  // [0.5, 1) * 2^..
    for (int64_t i = 0; i < count; ++i) {
      const uint32_t r = next();
      const uint16_t v = uint16_t(((r >> 31) << 15) | (uint32_t(e) << 7) | (r & 0x7f));
      std::memcpy(&b[size_t(i) * 2], &v, 2);
    }
    return add(n, DType::kBF16, shape, std::move(b));
  }
  const TensorView* f32(const std::string& n, std::vector<int64_t> shape, double mag,
                        double offset = 0) {
    const int64_t count = numel(shape);
    std::vector<uint8_t> b(size_t(count) * 4);
    for (int64_t i = 0; i < count; ++i) {
      const float v = float(offset + mag * (double(next() % 2001) / 1000.0 - 1.0));
      std::memcpy(&b[size_t(i) * 4], &v, 4);
    }
    return add(n, DType::kF32, shape, std::move(b));
  }
  // FP8 e4m3 codes in +-[0.5, 2) (exponent bits 0110/0111) x one UE8M0 scale of 1/sqrt(in).
  Fp8Ref fp8(const std::string& n, int64_t out, int64_t in) {
    std::vector<uint8_t> w(size_t(out * in));
    for (auto& x : w) x = uint8_t(0x30 | (next() & 0x8f));
    const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
    const uint8_t s = uint8_t(127 - std::lround(0.5 * std::log2(double(in))));
    return {add(n + ".weight", DType::kF8E4M3, {out, in}, std::move(w)),
            add(n + ".scale", DType::kF8E8M0, {so, si}, std::vector<uint8_t>(size_t(so * si), s))};
  }
  Fp4Ref fp4(const std::string& n, int64_t out, int64_t in, ExpertFormat f) {
    Fp4Ref r;
    r.format = f;
    std::vector<uint8_t> w(size_t(out * in / 2));
    for (auto& x : w) x = uint8_t(next());
    const double scale = 1.0 / std::sqrt(double(in)) / 3.0;  // e2m1 values average ~3
    r.weight = add(n + ".weight", f == ExpertFormat::kMxfp4 ? DType::kI8 : DType::kU8,
                   {out, in / 2}, std::move(w));
    if (f == ExpertFormat::kMxfp4) {
      const uint8_t s = uint8_t(127 + std::lround(std::log2(scale)));
      r.scale = add(n + ".scale", DType::kF8E8M0, {out, in / 32},
                    std::vector<uint8_t>(size_t(out * in / 32), s));
    } else {
      std::vector<uint8_t> s(size_t(out * in / 16));
      for (auto& x : s) x = uint8_t(0x30 + next() % 16);  // E4M3 in [0.5, 2)
      r.scale = add(n + ".weight_scale", DType::kF8E4M3, {out, in / 16}, std::move(s));
      r.scale_2 = f32(n + ".weight_scale_2", {}, 0, scale);
      r.input_scale = f32(n + ".input_scale", {}, 0, 1.0);
    }
    return r;
  }
  CompressorRef compressor(const std::string& p, int ratio, int d, int dim) {
    const int coff = ratio == 4 ? 2 : 1;
    const double m = 1.0 / std::sqrt(double(dim));
    return {bf16(p + "wkv.weight", {coff * d, dim}, m),
            bf16(p + "wgate.weight", {coff * d, dim}, m), f32(p + "ape", {ratio, coff * d}, 0.5),
            bf16(p + "norm.weight", {d}, 1.0)};
  }
  HcRef hc(const std::string& p, int rows, int width, int nscale) {
    return {f32(p + "_fn", {rows, width}, 1.0 / std::sqrt(double(width))),
            f32(p + "_base", {rows}, 0.5), f32(p + "_scale", {nscale}, 0.2, 0.5)};
  }

 private:
  static int64_t numel(const std::vector<int64_t>& s) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    return n;
  }
  uint32_t next() { return uint32_t(rng_() >> 32); }
  const TensorView* add(const std::string& n, DType dt, std::vector<int64_t> shape,
                        std::vector<uint8_t> b) {
    return tensors_.add(n, dt, std::move(shape), std::move(b));
  }
  std::mt19937_64 rng_;
  test::HostTensors tensors_;
};

// The checkpoint's inventory (as bind_weights binds it) with random contents.
WeightsRef random_weights(RandomWeights& R, const ModelConfig& c, ExpertFormat fmt) {
  WeightsRef w;
  const int dim = c.dim, hcd = c.hc_mult * c.dim, H = c.n_heads, hd = c.head_dim;
  w.embed = R.bf16("embed.weight", {c.vocab_size, dim}, 1.0);
  w.head = R.bf16("head.weight", {c.vocab_size, dim}, 1.0 / std::sqrt(double(dim)));
  w.norm = R.bf16("norm.weight", {dim}, 1.0);
  w.hc_head = R.hc("hc_head", c.hc_mult, hcd, 1);
  for (int i = 0; i < c.num_blocks(); ++i) {
    const std::string p = block_prefix(c, i);
    const int ratio = c.ratio(i);
    BlockRef b;
    b.index = i;
    b.hc_attn = R.hc(p + "hc_attn", c.mix_hc(), hcd, 3);
    b.hc_ffn = R.hc(p + "hc_ffn", c.mix_hc(), hcd, 3);
    b.attn_norm = R.bf16(p + "attn_norm.weight", {dim}, 1.0);
    b.ffn_norm = R.bf16(p + "ffn_norm.weight", {dim}, 1.0);
    AttentionRef& a = b.attn;
    a.wq_a = R.fp8(p + "attn.wq_a", c.q_lora_rank, dim);
    a.q_norm = R.bf16(p + "attn.q_norm.weight", {c.q_lora_rank}, 1.0);
    a.wq_b = R.fp8(p + "attn.wq_b", int64_t(H) * hd, c.q_lora_rank);
    a.wkv = R.fp8(p + "attn.wkv", hd, dim);
    a.kv_norm = R.bf16(p + "attn.kv_norm.weight", {hd}, 1.0);
    a.wo_a =
        R.fp8(p + "attn.wo_a", int64_t(c.o_groups) * c.o_lora_rank, int64_t(H) * hd / c.o_groups);
    a.wo_b = R.fp8(p + "attn.wo_b", dim, int64_t(c.o_groups) * c.o_lora_rank);
    a.attn_sink = R.f32(p + "attn.attn_sink", {H}, 0.5);
    if (ratio > 0) a.compressor = R.compressor(p + "attn.compressor.", ratio, hd, dim);
    if (ratio == 4) {
      IndexerRef ix;
      ix.wq_b = R.fp8(p + "attn.indexer.wq_b", int64_t(c.index_n_heads) * c.index_head_dim,
                      c.q_lora_rank);
      ix.weights_proj =
          R.bf16(p + "attn.indexer.weights_proj.weight", {c.index_n_heads, dim}, 1.0 / 64);
      ix.compressor = R.compressor(p + "attn.indexer.compressor.", 4, c.index_head_dim, dim);
      a.indexer = ix;
    }
    MoeRef& m = b.ffn;
    const int E = c.n_routed_experts, inter = c.moe_inter_dim;
    m.gate = R.bf16(p + "ffn.gate.weight", {E, dim}, 1.0 / std::sqrt(double(dim)));
    m.bias = R.f32(p + "ffn.gate.bias", {E}, 0.0);
    ExpertRef x;
    x.w1 = R.fp4(p + "ffn.experts.w1", inter, dim, fmt);
    x.w2 = R.fp4(p + "ffn.experts.w2", dim, inter, fmt);
    x.w3 = R.fp4(p + "ffn.experts.w3", inter, dim, fmt);
    m.experts.assign(E, x);
    m.shared_w1 = R.fp8(p + "ffn.shared_experts.w1", inter, dim);
    m.shared_w2 = R.fp8(p + "ffn.shared_experts.w2", dim, inter);
    m.shared_w3 = R.fp8(p + "ffn.shared_experts.w3", inter, dim);
    if (i >= c.n_layers) {  // the MTP block (--speculative)
      MtpRef t;
      t.e_proj = R.fp8(p + "e_proj", dim, dim);
      t.h_proj = R.fp8(p + "h_proj", dim, dim);
      t.enorm = R.bf16(p + "enorm.weight", {dim}, 1.0);
      t.hnorm = R.bf16(p + "hnorm.weight", {dim}, 1.0);
      t.norm = R.bf16(p + "norm.weight", {dim}, 1.0);
      t.hc_head = R.hc(p + "hc_head", c.hc_mult, hcd, 1);
      b.mtp = t;
    }
    w.blocks.push_back(std::move(b));
  }
  return w;
}

// ---- shapes ---------------------------------------------------------------------------------

struct Shape {
  std::string name;
  ModelConfig config;
  int full_layers;
  std::vector<std::pair<int, int>> full_mix;  // (ratio, count) of the real model
};

// The measured model: `ratios` layers of the real geometry (real_config.h), no hash routing, no
// MTP block; the real model's layer count and mix from the same file.
Shape real_shape(const std::string& name, bool nvfp4, std::vector<int> ratios) {
  ModelConfig c = bench::real_config(name, nvfp4);
  Shape s{name, c, c.n_layers, {}};
  std::map<int, int> mix;
  for (int b = 0; b < c.n_layers; ++b) ++mix[c.ratio(b)];
  s.full_mix.assign(mix.begin(), mix.end());
  s.config.n_layers = int(ratios.size());
  s.config.n_mtp_layers = 0;
  s.config.n_hash_layers = 0;
  s.config.compress_ratios = std::move(ratios);
  return s;
}

Shape flash_shape(bool nvfp4) {
  return real_shape("flash", nvfp4, {0, 4, 128});
}

Shape pro_shape(bool nvfp4) {
  return real_shape("pro", nvfp4, {4, 128});
}

// ---- rooflines ------------------------------------------------------------------------------

struct Cost {
  double bytes = 0, fp8_flops = 0, bf16_flops = 0;
  double flops() const { return fp8_flops + bf16_flops; }
  // The tensor rate that makes flops / rate the sum of both formats' times.
  double rate() const {
    const double t = fp8_flops / bench::kFp8Tflops + bf16_flops / bench::kBf16Tflops;
    return t > 0 ? flops() / t : bench::kBf16Tflops;
  }
  double bound_us() const {
    return std::max(bytes / (bench::kHbmTBps * 1e6),
                    (fp8_flops / bench::kFp8Tflops + bf16_flops / bench::kBf16Tflops) / 1e6);
  }
};

// One layer of kind `ratio`, a step of `tokens` tokens over `seqs` sequences whose queries sit
// at positions ~`ctx` (decode) or 0..tokens-1 (prefill of one sequence, ctx = 0).
Cost layer_cost(const ModelConfig& c, int ratio, ExpertFormat fmt, int tokens, int seqs,
                int64_t ctx) {
  Cost k;
  const double dim = c.dim, H = c.n_heads, D = c.head_dim, QL = c.q_lora_rank;
  const double GOL = double(c.o_groups) * c.o_lora_rank, inter = c.moe_inter_dim;
  const double HI = c.index_n_heads, DI = c.index_head_dim, E = c.n_routed_experts;
  double fp8 =
      QL * dim + H * D * QL + D * dim + GOL * (H * D / c.o_groups) + dim * GOL + 3 * inter * dim;
  double bf16 = E * dim;  // router gate
  if (ratio > 0) bf16 += (ratio == 4 ? 2 * 2 * D : 2 * D) * dim;
  if (ratio == 4) {
    fp8 += HI * DI * QL;
    bf16 += 2 * 2 * DI * dim + HI * dim;
  }
  const double bits = fmt == ExpertFormat::kMxfp4 ? 4.25 : 4.5;
  const double expert_bytes = 3 * inter * dim * bits / 8;
  const double picks = double(tokens) * c.n_activated_experts;
  const double touched = E * (1 - std::pow(1 - c.n_activated_experts / E, double(tokens)));
  const double hc_bytes = 2.0 * c.mix_hc() * c.hc_mult * dim * 4;
  k.bytes = fp8 + 2 * bf16 + touched * expert_bytes + hc_bytes;
  // Dense (FP8 rate; wo_a is W8A16 BF16), experts at BF16 (W4A16), router/compressor BF16.
  const double wo_a = GOL * (H * D / c.o_groups);
  k.fp8_flops = 2.0 * tokens * (fp8 - wo_a);
  k.bf16_flops = 2.0 * tokens * (wo_a + bf16) + 2.0 * picks * 3 * inter * dim;
  // Attention and indexer per query.
  const double kv_entry = 584, key_entry = 68;
  for (int q = 0; q < tokens; ++q) {
    const double p = ctx > 0 ? double(ctx) : double(q);
    double keys = std::min(p + 1, double(c.window_size));
    if (ratio == 4) keys += std::min(double(c.index_topk), std::floor((p + 1) / 4));
    if (ratio == 128) keys += std::floor((p + 1) / 128);
    k.bf16_flops += 2.0 * H * keys * 2 * D;
    if (ratio == 4) k.bf16_flops += 2.0 * HI * DI * std::floor((p + 1) / 4);
    if (ctx > 0) {  // decode: every query is its own sequence, reading its cache
      k.bytes += keys * kv_entry;
      if (ratio == 4) k.bytes += std::floor((p + 1) / 4) * key_entry;
    }
  }
  (void)seqs;
  return k;
}

Cost head_cost(const ModelConfig& c, int rows) {
  Cost k;
  k.bytes = double(c.vocab_size) * c.dim * 2;
  k.bf16_flops = 2.0 * rows * c.vocab_size * c.dim;
  return k;
}

// ---- the runs ---------------------------------------------------------------------------------

int64_t median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return int64_t(v[v.size() / 2] * 1000.0f);  // ms -> us
}

void fill_caches(DeviceCache& cache, int blocks) {
  // A finite pattern everywhere: e4m3 0x38 = 1.0, BF16 0x3838 ~ 4e-5, scales 2^-71, e2m1 +-1.5.
  for (int b = 0; b < blocks; ++b)
    for (int kind = 0; kind < 3; ++kind) {
      const auto [p, n] = cache.store_range(b, kind);
      if (p && n) DSV4_CUDA_CHECK(cudaMemset(const_cast<uint8_t*>(p), 0x38, size_t(n)));
    }
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
}

void emit(const std::string& kernel, const std::string& shape, double us, const Cost& k) {
  bench::Result r;
  r.kernel = kernel;
  r.shape = shape;
  r.us = us;
  r.bytes = k.bytes;
  r.flops = k.flops();
  r.tensor_rate_tflops = k.rate();
  r.peer = "roofline";
  r.peer_us = k.bound_us();
  r.emit();
}

// One decode step of every sequence on a random token, greedy samples on the device (only the
// ids come back): the serving step both modes time.
void sampled_decode_step(CudaRunner& runner, const std::vector<int>& seqs,
                         std::vector<SampleSpec>& specs, std::mt19937& rng, int vocab) {
  std::vector<StepInput> in;
  for (size_t i = 0; i < seqs.size(); ++i) {
    StepInput x(seqs[i], {int32_t(2 + rng() % (vocab - 2))});
    x.logits = false;
    x.sample = &specs[i];
    in.push_back(std::move(x));
  }
  runner.step(in);
}

void run_shape(const Shape& s, ExpertFormat fmt, bool quick, bool exact) {
  const ModelConfig& c = s.config;
  const std::string fname_s = std::string(fmt == ExpertFormat::kNvfp4 ? "nvfp4" : "mxfp4") +
                              (exact ? " exact-linears" : "");
  const char* fname = fname_s.c_str();
  std::fprintf(stderr, "[%s %s] building %d blocks (random weights)...\n", s.name.c_str(), fname,
               c.n_layers);
  RandomWeights R(1234);
  const WeightsRef ref = random_weights(R, c, fmt);
  CudaModelWeights w = upload_cuda_weights(c, ref, true);
  std::fprintf(stderr, "[%s %s] weights: %.2f GiB on the GPU\n", s.name.c_str(), fname,
               double(w.device_bytes) / double(1ull << 30));
  const std::vector<int> batches =
      quick ? std::vector<int>{1, 128} : std::vector<int>{1, 8, 32, 128};
  const std::vector<int64_t> contexts = {4096, 65536};
  const int prefill = 8192;
  CudaModelLimits lim;
  lim.max_tokens = prefill;
  lim.max_seqs = 128;
  lim.max_context = 65536 + 256;
  lim.max_logit_rows = 128;
  lim.exact_linears = exact;
  DeviceContext ctx(0);
  CudaModel model(ctx, c, std::move(w), lim);
  std::fprintf(stderr, "[%s %s] activations: %.2f GiB\n", s.name.c_str(), fname,
               double(model.activation_bytes()) / double(1ull << 30));
  const CacheConfig cc = cache_capacity(c, 128, lim.max_context, 64);
  CudaRunnerOptions graphs;
  graphs.cuda_graphs = true;
  CudaRunner runner(model, cc, graphs);
  fill_caches(runner.cache(), c.n_layers);
  std::mt19937 rng(5);

  auto per_layer = [&](const std::vector<std::vector<float>>& times, int i) {
    std::vector<float> v;
    for (const auto& t : times) v.push_back(t[i]);
    return median(v);
  };
  // Extrapolated step of the full model from per-layer times (us) and the head.
  auto extrapolate = [&](const std::vector<int64_t>& layer_us, int64_t head_us) {
    double t = double(head_us);
    for (const auto& [ratio, count] : s.full_mix)
      for (int b = 0; b < c.n_layers; ++b)
        if (c.ratio(b) == ratio) t += double(count) * double(layer_us[b]);
    return t;
  };
  auto full_cost = [&](int tokens, int64_t ctx, int rows) {
    Cost k = head_cost(c, rows);
    for (const auto& [ratio, count] : s.full_mix) {
      const Cost l = layer_cost(c, ratio, fmt, tokens, tokens, ctx);
      k.bytes += count * l.bytes;
      k.fp8_flops += count * l.fp8_flops;
      k.bf16_flops += count * l.bf16_flops;
    }
    return k;
  };

  for (int64_t ctx : contexts) {
    for (int B : batches) {
      std::vector<int> seqs;
      for (int i = 0; i < B; ++i) {
        seqs.push_back(runner.open_sequence());
        runner.sequence(seqs.back()).tokens = ctx;  // the cache "holds" ctx tokens already
      }
      auto step = [&]() {
        std::vector<StepInput> in;
        for (int id : seqs) in.push_back({id, {int32_t(2 + rng() % (c.vocab_size - 2))}, false});
        // A caller that hands the output back (as the engine loop does) gets the next step's
        // logits in the same storage.
        runner.recycle(runner.step(in));
      };
      // The engine loop's decode step: greedy samples, no logits returned (sampled on the
      // device; only the ids come back).
      SamplingParams greedy;
      std::vector<SampleSpec> specs(static_cast<size_t>(B));
      for (SampleSpec& sp : specs) sp.params = &greedy;
      auto sampled_step = [&]() { sampled_decode_step(runner, seqs, specs, rng, c.vocab_size); };
      // Graph warm-up (eager, capture), then timed replays with per-block events.
      model.set_block_timing(true);
      for (int i = 0; i < 3; ++i) step();
      std::vector<std::vector<float>> times;
      std::vector<float> steps;
      const int iters = quick ? 10 : 30;
      cudaEvent_t a, b;
      DSV4_CUDA_CHECK(cudaEventCreate(&a));
      DSV4_CUDA_CHECK(cudaEventCreate(&b));
      for (int i = 0; i < iters; ++i) {
        DSV4_CUDA_CHECK(cudaEventRecord(a, model.stream()));
        step();  // synchronises (logits download)
        DSV4_CUDA_CHECK(cudaEventRecord(b, model.stream()));
        DSV4_CUDA_CHECK(cudaEventSynchronize(b));
        float ms;
        DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
        steps.push_back(ms);
        times.push_back(model.block_times_ms());
      }
      // (Block timing stays on: the captured graph records its events, which must outlive it.)
      std::vector<float> sampled;
      for (int i = 0; i < 3; ++i) sampled_step();
      for (int i = 0; i < iters; ++i) {
        DSV4_CUDA_CHECK(cudaEventRecord(a, model.stream()));
        sampled_step();  // synchronises (the sampled ids, to pinned memory)
        DSV4_CUDA_CHECK(cudaEventRecord(b, model.stream()));
        DSV4_CUDA_CHECK(cudaEventSynchronize(b));
        float ms;
        DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
        sampled.push_back(ms);
      }
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      model.set_block_timing(false);
      for (int id : seqs) runner.close_sequence(id);

      char shape[160];
      std::vector<int64_t> layer_us;
      for (int bl = 0; bl < c.n_layers; ++bl) {
        layer_us.push_back(per_layer(times, bl));
        const int ratio = c.ratio(bl);
        std::snprintf(shape, sizeof shape, "%s %s %s layer, decode b=%d ctx=%lld", s.name.c_str(),
                      fname,
                      ratio == 4     ? "CSA"
                      : ratio == 128 ? "HCA"
                                     : "SWA",
                      B, (long long)ctx);
        emit("e2e_decode_layer", shape, double(layer_us.back()),
             layer_cost(c, ratio, fmt, B, B, ctx));
      }
      const int64_t head_us = per_layer(times, c.n_layers);
      std::snprintf(shape, sizeof shape, "%s %s head, decode b=%d", s.name.c_str(), fname, B);
      emit("e2e_decode_head", shape, double(head_us), head_cost(c, B));
      const double measured = double(median(steps));
      std::snprintf(shape, sizeof shape, "%s %s %d-block model (measured), decode b=%d ctx=%lld",
                    s.name.c_str(), fname, c.n_layers, B, (long long)ctx);
      Cost part = head_cost(c, B);
      for (int bl = 0; bl < c.n_layers; ++bl) {
        const Cost l = layer_cost(c, c.ratio(bl), fmt, B, B, ctx);
        part.bytes += l.bytes, part.fp8_flops += l.fp8_flops, part.bf16_flops += l.bf16_flops;
      }
      emit("e2e_decode_step_measured", shape, measured, part);
      std::snprintf(shape, sizeof shape,
                    "%s %s %d-block model (measured, greedy samples on the device), decode b=%d "
                    "ctx=%lld",
                    s.name.c_str(), fname, c.n_layers, B, (long long)ctx);
      emit("e2e_decode_step_sampled", shape, double(median(sampled)), part);
      const double full = extrapolate(layer_us, head_us);
      std::snprintf(shape, sizeof shape,
                    "%s %s %d layers EXTRAPOLATED from per-layer times, decode b=%d ctx=%lld, "
                    "%.0f tokens/s",
                    s.name.c_str(), fname, s.full_layers, B, (long long)ctx, B * 1e6 / full);
      emit("e2e_decode_step_extrapolated", shape, full, full_cost(B, ctx, B));
    }
  }

  // Prefill of 8K tokens (one sequence from position 0), eager with per-block events.
  {
    std::vector<int32_t> prompt(prefill);
    for (auto& t : prompt) t = int32_t(2 + rng() % (c.vocab_size - 2));
    CudaRunnerOptions eager;
    eager.cuda_graphs = false;
    std::vector<std::vector<float>> times;
    std::vector<float> steps;
    model.set_block_timing(true);
    for (int i = 0; i < (quick ? 2 : 4); ++i) {
      const int id = runner.open_sequence();
      cudaEvent_t a, b;
      DSV4_CUDA_CHECK(cudaEventCreate(&a));
      DSV4_CUDA_CHECK(cudaEventCreate(&b));
      DSV4_CUDA_CHECK(cudaEventRecord(a, model.stream()));
      runner.step({{id, prompt, false}});
      DSV4_CUDA_CHECK(cudaEventRecord(b, model.stream()));
      DSV4_CUDA_CHECK(cudaEventSynchronize(b));
      float ms;
      DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      runner.close_sequence(id);
      if (i == 0) continue;  // warm-up
      steps.push_back(ms);
      times.push_back(model.block_times_ms());
    }
    model.set_block_timing(false);
    char shape[160];
    std::vector<int64_t> layer_us;
    for (int bl = 0; bl < c.n_layers; ++bl) {
      layer_us.push_back(per_layer(times, bl));
      const int ratio = c.ratio(bl);
      std::snprintf(shape, sizeof shape, "%s %s %s layer, prefill %d tokens", s.name.c_str(), fname,
                    ratio == 4     ? "CSA"
                    : ratio == 128 ? "HCA"
                                   : "SWA",
                    prefill);
      emit("e2e_prefill_layer", shape, double(layer_us.back()),
           layer_cost(c, ratio, fmt, prefill, 1, 0));
    }
    const int64_t head_us = per_layer(times, c.n_layers);
    const double full = extrapolate(layer_us, head_us);
    std::snprintf(shape, sizeof shape,
                  "%s %s %d layers EXTRAPOLATED from per-layer times, prefill %d tokens, "
                  "%.0f tokens/s",
                  s.name.c_str(), fname, s.full_layers, prefill, prefill * 1e6 / full);
    emit("e2e_prefill_extrapolated", shape, full, full_cost(prefill, 0, 1));
  }
}

// --speculative: issue 16's verify step against the plain decode step, at batch 1, 8, 32 and
// k = 1-3 drafts, 4K context, the shape's blocks plus the MTP block. The plain step: a runner
// without speculation, greedy samples on the device, CUDA graphs (the engine's decode step).
// The speculative step: a runner with speculation, every sequence bringing its last token and
// k drafts (verify k, draft k): the target forward over k + 1 tokens per sequence, the
// sampling of every verified row, the rollback saves, the MTP block's run and its k chained
// drafts — with the drafts forced (SampleSpec forced_from / draft_override) either all right
// (no rollback) or all wrong (restore + rerun of the kept token, the worst case). Both runners
// run CUDA graphs as the engine does: the verify forward, the rerun, the MTP block's run and
// each draft step replay graphs captured during the warm-up steps (the step's host work — the
// rollback's segment lists, the sampler's staging, acceptance — stays outside them); the
// count of replays per step is printed, so a step that fell back to eager shows.
// Both steps are also EXTRAPOLATED to the full model: the measured step minus its measured
// blocks plus the full layer mix at the per-layer times (what does not scale with layers —
// head, MTP block, sampling, rollback, synchronisation — stays as measured). Tokens per second
// at the peers' acceptance lengths (1.8 for k = 1; 2.5 and 3.1 for k = 3) are a PROJECTION
// from these step times: acceptance length / verify step, between the all-accepted and the
// all-rejected step times (under Rollback::kRerun a partly accepted step reruns its kept
// tokens; under kRestore it does not: both rollbacks are timed).
void run_speculative(const Shape& s, ExpertFormat fmt, bool quick, bool exact) {
  ModelConfig c = s.config;
  c.n_mtp_layers = 1;
  c.compress_ratios.push_back(0);  // the MTP block: sliding window only
  const std::string fname = std::string(fmt == ExpertFormat::kNvfp4 ? "nvfp4" : "mxfp4") +
                            (exact ? " exact-linears" : "");
  std::fprintf(stderr, "[%s %s] building %d blocks + MTP (random weights)...\n", s.name.c_str(),
               fname.c_str(), c.n_layers);
  RandomWeights R(1234);
  const WeightsRef ref = random_weights(R, c, fmt);
  CudaModelWeights w = upload_cuda_weights(c, ref, true);
  const int max_b = 32, ctx = 4096;
  CudaModelLimits lim;
  lim.max_tokens = max_b * (kMaxDraftTokens + 1);
  lim.max_seqs = max_b;
  lim.max_context = ctx + 1024;
  lim.max_logit_rows = lim.max_tokens;
  lim.exact_linears = exact;
  DeviceContext dctx(0);
  CudaModel model(dctx, c, std::move(w), lim);
  const CacheConfig cc = cache_capacity(c, max_b, lim.max_context, 64);
  CudaRunnerOptions graphs;
  graphs.cuda_graphs = true;
  CudaRunner plain(model, cc, graphs);
  // One runner per rollback (Rollback, model/runner.h): all-rejected steps are timed with each.
  CudaRunner spec(model, cc, graphs), spec_restore(model, cc, graphs);
  spec.enable_speculation(Rollback::kRerun);
  spec_restore.enable_speculation(Rollback::kRestore);
  fill_caches(plain.cache(), c.num_blocks());
  fill_caches(spec.cache(), c.num_blocks());
  fill_caches(spec_restore.cache(), c.num_blocks());
  std::mt19937 rng(5);
  const int iters = quick ? 8 : 20;
  SamplingParams greedy;
  model.set_block_timing(true);

  // Median step time (us) and per-block times of the target forward of `step`.
  struct Timed {
    double step_us = 0, blocks_us = 0, full_us = 0;
  };
  auto time_steps = [&](const std::function<void()>& step) {
    for (int i = 0; i < 3; ++i) step();  // warm-up (eager, capture)
    std::vector<float> steps;
    std::vector<std::vector<float>> blocks;
    cudaEvent_t a, b;
    DSV4_CUDA_CHECK(cudaEventCreate(&a));
    DSV4_CUDA_CHECK(cudaEventCreate(&b));
    for (int i = 0; i < iters; ++i) {
      DSV4_CUDA_CHECK(cudaEventRecord(a, model.stream()));
      step();
      DSV4_CUDA_CHECK(cudaEventRecord(b, model.stream()));
      DSV4_CUDA_CHECK(cudaEventSynchronize(b));
      float ms;
      DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      steps.push_back(ms);
      blocks.push_back(model.block_times_ms());
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    Timed t;
    t.step_us = double(median(steps));
    double full = 0;
    for (int bl = 0; bl < c.n_layers; ++bl) {
      std::vector<float> v;
      for (const auto& x : blocks) v.push_back(x[size_t(bl)]);
      const double us = double(median(v));
      t.blocks_us += us;
      for (const auto& [ratio, count] : s.full_mix)
        if (c.ratio(bl) == ratio) full += double(count) * us;
    }
    t.full_us = t.step_us - t.blocks_us + full;
    return t;
  };
  auto open = [&](CudaRunner& r, int B) {
    std::vector<int> seqs;
    for (int i = 0; i < B; ++i) {
      seqs.push_back(r.open_sequence());
      SequenceCache& sq = r.sequence(seqs.back());
      sq.tokens = ctx;  // the cache "holds" ctx tokens already
      sq.mtp_tokens = ctx - 1;
    }
    return seqs;
  };
  auto emit_step = [&](const std::string& kernel, const std::string& shape, double us,
                       double peer_us) {
    bench::Result r;
    r.kernel = kernel;
    r.shape = shape;
    r.us = us;
    r.peer = "plain decode step";
    r.peer_us = peer_us;
    r.emit();
  };
  for (int B : std::vector<int>{1, 8, 32}) {
    // The plain step.
    std::vector<int> seqs = open(plain, B);
    std::vector<SampleSpec> specs(static_cast<size_t>(B));
    for (SampleSpec& sp : specs) sp.params = &greedy;
    const Timed base =
        time_steps([&]() { sampled_decode_step(plain, seqs, specs, rng, c.vocab_size); });
    for (int id : seqs) plain.close_sequence(id);
    char shape[200];
    std::snprintf(shape, sizeof shape, "%s %s b=%d ctx=%d: plain decode step, %d blocks + head",
                  s.name.c_str(), fname.c_str(), B, ctx, c.n_layers);
    emit_step("spec_plain_step_measured", shape, base.step_us, base.step_us);
    std::snprintf(shape, sizeof shape,
                  "%s %s b=%d ctx=%d: plain decode step, %d layers EXTRAPOLATED, %.0f tokens/s",
                  s.name.c_str(), fname.c_str(), B, ctx, s.full_layers, B * 1e6 / base.full_us);
    emit_step("spec_plain_step_extrapolated", shape, base.full_us, base.full_us);

    for (int k = 1; k <= kMaxDraftTokens; ++k) {
      // Extrapolated step times: all accepted, all rejected under kRerun, under kRestore.
      double full_accepted = 0, full_rerun = 0, full_restore = 0;
      double verify_layers = 0;  // the verify forward's extrapolated minus measured blocks
      for (int run = 1; run >= -1; --run) {
        const bool accept = run == 1, restore = run == -1;
        CudaRunner& rs = restore ? spec_restore : spec;
        seqs = open(rs, B);
        // Forced output and drafts along one random continuation per sequence: drafts equal
        // to it are all accepted, drafts off by one all rejected.
        std::vector<std::vector<int32_t>> cont(static_cast<size_t>(B)),
            drafts(static_cast<size_t>(B));
        for (int i = 0; i < B; ++i) {
          for (int t = 0; t < 4096; ++t) cont[size_t(i)].push_back(2 + int32_t(rng() % 1000));
          drafts[size_t(i)] = cont[size_t(i)];
          if (!accept)
            for (int32_t& t : drafts[size_t(i)]) ++t;
        }
        std::vector<int64_t> index(size_t(B), 0);
        std::vector<SampleSpec> sp(static_cast<size_t>(B));
        const int64_t replays0 = rs.graph_replays(), eager0 = rs.eager_shaped_steps();
        Timed t = time_steps([&]() {
          std::vector<StepInput> in;
          for (int i = 0; i < B; ++i) {
            // The sequence's last output is cont[last]; the drafts propose outputs last + 1 ..
            // last + k, which the forced samples make cont[last + 1] ...
            const std::vector<int32_t>& cn = cont[size_t(i)];
            const int64_t last = index[size_t(i)];
            SampleSpec& x = sp[size_t(i)];
            x.params = &greedy;
            x.index = last + 1;
            x.forced = cn[size_t(last + 1)];
            x.forced_from = &cn;
            x.draft_override = &drafts[size_t(i)];
            StepInput y(seqs[size_t(i)], {cn[size_t(last)]});
            for (int j = 1; j <= k; ++j) y.tokens.push_back(drafts[size_t(i)][size_t(last + j)]);
            y.verify = k;
            y.draft = k;
            y.logits = false;
            y.sample = &x;
            in.push_back(std::move(y));
          }
          const StepOutput o = rs.step(in);
          for (int i = 0; i < B; ++i) index[size_t(i)] += 1 + int64_t(o.more[size_t(i)].size());
        });
        for (int id : seqs) rs.close_sequence(id);
        // Per timed step (after warm-up): the verify, the MTP run and k drafts, plus the rerun
        // when rejected under Rollback::kRerun, each one graph replay.
        std::fprintf(stderr,
                     "  b=%d k=%d %s: %lld graph replays over %d steps (%d warm-up), %lld shaped "
                     "steps run eagerly\n",
                     B, k,
                     accept    ? "accepted"
                     : restore ? "rejected (restore)"
                               : "rejected (rerun)",
                     (long long)(rs.graph_replays() - replays0), iters + 3, 3,
                     (long long)(rs.eager_shaped_steps() - eager0));
        // Block times are of the step's last target forward: with every draft rejected under
        // kRerun that is the rerun (one token per sequence), so the verify forward's own
        // full-model extrapolation is added from the all-accepted run (the same verify
        // shapes); under kRestore the last forward is the verify itself.
        if (accept)
          verify_layers = t.full_us - t.step_us;
        else if (!restore)
          t.full_us += verify_layers;
        (accept ? full_accepted : restore ? full_restore : full_rerun) = t.full_us;
        const char* what = accept    ? "all drafts accepted"
                           : restore ? "all rejected, rollback restore"
                                     : "all rejected, rollback rerun (restore + rerun)";
        std::snprintf(shape, sizeof shape, "%s %s b=%d ctx=%d k=%d: verify step (%s), %.2fx plain",
                      s.name.c_str(), fname.c_str(), B, ctx, k, what, t.step_us / base.step_us);
        emit_step("spec_verify_step_measured", shape, t.step_us, base.step_us);
        std::snprintf(shape, sizeof shape,
                      "%s %s b=%d ctx=%d k=%d: verify step (%s), %d layers EXTRAPOLATED, %.2fx "
                      "plain",
                      s.name.c_str(), fname.c_str(), B, ctx, k, what, s.full_layers,
                      t.full_us / base.full_us);
        emit_step("spec_verify_step_extrapolated", shape, t.full_us, base.full_us);
      }
      // The projection at the peers' acceptance lengths, per rollback: between the
      // all-accepted and that rollback's all-rejected step time.
      for (double len : k == 1   ? std::vector<double>{1.8}
                        : k == 3 ? std::vector<double>{2.5, 3.1}
                                 : std::vector<double>{})
        for (const bool restore : {false, true}) {
          const double best = B * len * 1e6 / full_accepted,
                       worst = B * len * 1e6 / (restore ? full_restore : full_rerun);
          const double plain_tps = B * 1e6 / base.full_us;
          std::snprintf(shape, sizeof shape,
                        "%s %s b=%d ctx=%d k=%d acceptance length %.1f, rollback %s: PROJECTED "
                        "%.0f-%.0f tokens/s (plain %.0f), time per output token %.2f-%.2fx plain",
                        s.name.c_str(), fname.c_str(), B, ctx, k, len,
                        restore ? "restore" : "rerun", worst, best, plain_tps, plain_tps / best,
                        plain_tps / worst);
          // us: the projected time per output token of the sequence (all-accepted step time).
          emit_step("spec_projected_tpot", shape, full_accepted / len, base.full_us);
        }
    }
  }
  model.set_block_timing(false);
}

}  // namespace
}  // namespace dsv4

int main(int argc, char** argv) {
  using namespace dsv4;
  std::string which = "flash", fmt = "nvfp4";
  bool quick = false, exact = false, speculative = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "flash" || a == "pro")
      which = a;
    else if (a == "nvfp4" || a == "mxfp4")
      fmt = a;
    else if (a == "--quick")
      quick = true;
    else if (a == "--exact-linears")
      exact = true;
    else if (a == "--speculative")
      speculative = true;
    else {
      std::fprintf(stderr,
                   "usage: e2e_decode_bench [flash|pro] [nvfp4|mxfp4] [--quick] "
                   "[--exact-linears] [--speculative]\n");
      return 2;
    }
  }
  try {
    const bool nv = fmt == "nvfp4";
    const Shape shape = which == "pro" ? pro_shape(nv) : flash_shape(nv);
    const ExpertFormat f = nv ? ExpertFormat::kNvfp4 : ExpertFormat::kMxfp4;
    if (speculative)
      run_speculative(shape, f, quick, exact);
    else
      run_shape(shape, f, quick, exact);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "e2e_decode_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
