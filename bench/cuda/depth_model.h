// What the depth benchmarks share (bench/cuda/e2e_depth_bench.cu, one GPU, and
// bench/cuda/parallel_step_bench.cu, the parallel engine): the V4-Flash / V4-Pro geometry with
// the real layer mix, the rooflines per layer, op class and step, and the JSON-line output in
// bench_util.h's fields. Host code only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/bench_util.h"
#include "cuda/real_config.h"
#include "model/model_config.h"
#include "ops/common/weight_refs.h"

namespace dsv4::depth {

// ---- shapes -----------------------------------------------------------------------------------

// The real model's layer kinds, in order (compress ratio, hash-routed).
struct Model {
  std::string name;
  ModelConfig base;              // the real model's; config_with_layers cuts it per run
  std::vector<int> real_ratios;  // the real decoder's compress_ratios (MTP excluded)
  int hash_layers = 3;
};

// The real model's layer mix from its config file (real_config.h): V4-Flash layers 0, 1 SWA,
// even 2..42 CSA, odd 3..41 HCA; V4-Pro layers 0, 1 HCA, even 2..60 CSA, odd 3..59 HCA; the
// first 3 hash-routed (../shared/spec/v4_arch.md 1.2).
inline Model real_model(const std::string& name, bool nvfp4) {
  const ModelConfig c = bench::real_config(name, nvfp4);
  return Model{name, c,
               std::vector<int>(c.compress_ratios.begin(), c.compress_ratios.begin() + c.n_layers),
               c.n_hash_layers};
}
inline Model flash_model(bool nvfp4) {
  return real_model("flash", nvfp4);
}
inline Model pro_model(bool nvfp4) {
  return real_model("pro", nvfp4);
}

inline ModelConfig config_with_layers(const Model& m, int n) {
  ModelConfig c = m.base;
  c.n_layers = n;
  c.n_hash_layers = std::min(m.hash_layers, n);
  c.compress_ratios.assign(m.real_ratios.begin(), m.real_ratios.begin() + n);
  c.compress_ratios.push_back(0);  // MTP
  c.validate();
  return c;
}

// Layer kinds: the attention kind and the routing.
inline std::string kind_of(const ModelConfig& c, int block) {
  const int r = c.ratio(block);
  std::string k = block >= c.n_layers ? "MTP" : r == 4 ? "CSA" : r == 128 ? "HCA" : "SWA";
  if (block < c.n_layers && c.is_hash_layer(block)) k += "-hash";
  return k;
}
inline std::map<std::string, int> kind_counts(const Model& m, int n_layers) {
  const ModelConfig c = config_with_layers(m, n_layers);
  std::map<std::string, int> k;
  for (int b = 0; b < n_layers; ++b) ++k[kind_of(c, b)];
  return k;
}

// ---- rooflines ------------------------------------------------------------------------------

struct Cost {
  double bytes = 0, fp8_flops = 0, bf16_flops = 0;
  double flops() const { return fp8_flops + bf16_flops; }
  double bound_us() const {
    return std::max(bytes / (bench::kHbmTBps * 1e6),
                    (fp8_flops / bench::kFp8Tflops + bf16_flops / bench::kBf16Tflops) / 1e6);
  }
  Cost& operator+=(const Cost& o) {
    bytes += o.bytes, fp8_flops += o.fp8_flops, bf16_flops += o.bf16_flops;
    return *this;
  }
};

// Op classes of a layer (kernel names map onto them in op_class()).
const char* const kOpClasses[] = {"mhc",        "fp8_gemm", "wo_a",     "attention", "moe",
                                  "norm_quant", "head",     "sampling", "copy",      "other"};

// One layer of compress ratio `ratio` for a step of `tokens` query rows at positions ~`ctx`
// (decode: each row its own sequence reading its own cache) or 0..tokens-1 (prefill, ctx 0),
// by op class. Dense FP8 GEMMs at the FP8 rate; wo_a (W8A16), the experts (W4A16), router,
// compressor, indexer and attention at the BF16 rate. The MTP block adds e_proj, h_proj and
// the head.
inline std::map<std::string, Cost> layer_costs(const ModelConfig& c, int ratio, ExpertFormat fmt,
                                               int tokens, int64_t ctx, bool mtp = false) {
  std::map<std::string, Cost> k;
  const double T = tokens, dim = c.dim, H = c.n_heads, D = c.head_dim, QL = c.q_lora_rank;
  const double GOL = double(c.o_groups) * c.o_lora_rank, inter = c.moe_inter_dim;
  const double HI = c.index_n_heads, DI = c.index_head_dim, E = c.n_routed_experts;
  const double hcd = double(c.hc_mult) * c.dim;
  // Dense FP8 weights (every FP8 GEMM but wo_a).
  double fp8 = QL * dim + H * D * QL + D * dim + dim * GOL + 3 * inter * dim;
  if (ratio == 4) fp8 += HI * DI * QL;
  if (mtp) fp8 += 2 * dim * dim;
  k["fp8_gemm"].bytes = fp8;
  k["fp8_gemm"].fp8_flops = 2 * T * fp8 + (mtp ? 2 * T * (c.hc_mult - 1) * dim * dim : 0);
  const double wo_a = GOL * (H * D / c.o_groups);
  k["wo_a"].bytes = wo_a;
  k["wo_a"].bf16_flops = 2 * T * wo_a;
  // mHC: two units' fp32 weights, each reading the streams and writing them back (pre + post).
  k["mhc"].bytes = 2 * c.mix_hc() * hcd * 4 + 2 * T * (2 * hcd * 2);
  k["mhc"].bf16_flops = 2 * 2 * T * c.mix_hc() * hcd;
  // MoE: router gate (BF16) + the experts the step is expected to touch + activations.
  const double bits = fmt == ExpertFormat::kMxfp4 ? 4.25 : 4.5;
  const double expert_bytes = 3 * inter * dim * bits / 8;
  const double picks = T * c.n_activated_experts;
  const double touched = E * (1 - std::pow(1 - c.n_activated_experts / E, T));
  k["moe"].bytes = E * dim * 2 + touched * expert_bytes + 2 * T * dim * 2;
  k["moe"].bf16_flops = 2 * T * E * dim + 2 * picks * 3 * inter * dim;
  // Attention: compressor projections (BF16), indexer weights, and per query the keys it
  // attends (window + top-k or all compressed entries) and the indexer keys it scores.
  Cost& at = k["attention"];
  double comp = 0;
  if (ratio > 0) comp += (ratio == 4 ? 2 * 2 * D : 2 * D) * dim;
  if (ratio == 4) comp += 2 * 2 * DI * dim + HI * dim;
  at.bytes = 2 * comp;
  at.bf16_flops = 2 * T * comp;
  const double kv_entry = 584, key_entry = 68;
  for (int q = 0; q < tokens; ++q) {
    const double p = ctx > 0 ? double(ctx) : double(q);
    double keys = std::min(p + 1, double(c.window_size));
    if (ratio == 4) keys += std::min(double(c.index_topk), std::floor((p + 1) / 4));
    if (ratio == 128) keys += std::floor((p + 1) / 128);
    at.bf16_flops += 2.0 * H * keys * 2 * D;
    if (ratio == 4) at.bf16_flops += 2.0 * HI * DI * std::floor((p + 1) / 4);
    if (ctx > 0) {
      at.bytes += keys * kv_entry;
      if (ratio == 4) at.bytes += std::floor((p + 1) / 4) * key_entry;
    }
  }
  if (mtp) {
    k["head"].bytes = double(c.vocab_size) * dim * 2;
    k["head"].bf16_flops = 2 * T * c.vocab_size * dim;
  }
  return k;
}
inline Cost total(const std::map<std::string, Cost>& m) {
  Cost t;
  for (const auto& [n, c] : m) t += c;
  return t;
}
inline Cost layer_cost(const ModelConfig& c, int ratio, ExpertFormat fmt, int tokens, int64_t ctx,
                       bool mtp = false) {
  return total(layer_costs(c, ratio, fmt, tokens, ctx, mtp));
}
inline Cost head_cost(const ModelConfig& c, int rows) {
  Cost k;
  k.bytes = double(c.vocab_size) * c.dim * 2;
  k.bf16_flops = 2.0 * rows * c.vocab_size * c.dim;
  return k;
}

// ---- output -----------------------------------------------------------------------------------

inline std::string jstr(const std::string& s) {
  std::string o = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    o += ch;
  }
  return o + "\"";
}

// One JSON line in bench_util.h's fields (scripts/bench_report.py reads them) plus `extra`
// ("key":value pairs, already JSON).
inline void emit(const std::string& kernel, const std::string& shape, double us, const Cost& k,
                 const std::string& extra) {
  const double bound = k.bound_us();
  const double tflops = us > 0 ? k.flops() / us / 1e6 : 0, tbps = us > 0 ? k.bytes / us / 1e6 : 0;
  char line[2048];
  std::snprintf(line, sizeof line,
                "{\"kernel\":%s,\"shape\":%s,\"us\":%.2f,\"TFLOPS\":%.1f,\"TBps\":%.3f,"
                "\"roofline_us\":%.2f,\"of_roofline\":%.3f,\"peer\":\"roofline\",\"peer_us\":%.2f,"
                "\"gpu\":%s,\"date\":\"%s\",\"commit\":%s%s%s}",
                jstr(kernel).c_str(), jstr(shape).c_str(), us, tflops, tbps, bound,
                us > 0 ? bound / us : 0.0, bound, jstr(bench::gpu_name()).c_str(),
                bench::today().c_str(), jstr(bench::commit()).c_str(), extra.empty() ? "" : ",",
                extra.c_str());
  std::printf("%s\n", line);
  std::fflush(stdout);
  if (const char* out = std::getenv("DSV4_BENCH_OUT")) {
    if (FILE* f = std::fopen(out, "a")) {
      std::fprintf(f, "%s\n", line);
      std::fclose(f);
    }
  }
}

struct Extra {
  std::ostringstream s;
  bool first = true;
  Extra& kv(const char* k, const std::string& v) {
    s << (first ? "" : ",") << "\"" << k << "\":" << jstr(v);
    first = false;
    return *this;
  }
  Extra& kv(const char* k, double v) {
    s << (first ? "" : ",") << "\"" << k << "\":" << v;
    first = false;
    return *this;
  }
  std::string str() const { return s.str(); }
};

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace dsv4::depth
