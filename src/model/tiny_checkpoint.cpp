#include "model/tiny_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/formats.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "io/tensor_store.h"
#include "model/weight_quant.h"
#include "model/weights.h"

namespace fs = std::filesystem;

namespace dsv4 {
namespace {

// Residual-branch conditioning, as the golden sets: each branch output projection's gain is
// rho times a coefficient measured to give a branch RMS of about rho of the stream RMS.
constexpr double kRho = 0.03125;
constexpr double kAttnOutCoef = 6.9, kSharedOutCoef = 1.2;
// Calibrated input amax of the NVFP4 experts (ModelOpt's input_scale = amax / (6*448)).
constexpr float kNvfp4InputAmax = 8.0f;

// Generates the tensors into a sink (a safetensors writer or a TensorStore).
class Generator {
 public:
  static constexpr size_t kChunk = size_t(1) << 20;

  Generator(uint64_t seed, ExpertFormat fmt, const TinyInit& init, TensorSink& sink)
      : rng_(seed), fmt_(fmt), init_(init), sink_(sink) {}

  std::vector<float> gaussian(size_t n, double std) {
    std::vector<float> v(n);
    if (init_.repeat_experts && n >= kChunk) return parallel_gaussian(std::move(v), std);
    for (auto& x : v) x = static_cast<float>(rng_.normal() * std);
    return v;
  }
  // repeat_experts' other speed-up: large draws in chunks of kChunk, each from its own seed
  // (taken from the main sequence), on every core. Other values than the serial draw.
  std::vector<float> parallel_gaussian(std::vector<float> v, double std) {
    const size_t chunks = (v.size() + kChunk - 1) / kChunk;
    const uint64_t base = rng_.below(uint64_t(1) << 62);
    parallel_for(int64_t(chunks), int64_t(v.size()) * 16, [&](int64_t c) {
      Rng r(base + uint64_t(c) * 0x9E3779B97F4A7C15ull);
      const size_t end = std::min(v.size(), size_t(c + 1) * kChunk);
      for (size_t i = size_t(c) * kChunk; i < end; ++i) v[i] = static_cast<float>(r.normal() * std);
    });
    return v;
  }

  void bf16(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * sizeof(bf16_t));
    bf16_t* out = reinterpret_cast<bf16_t*>(b.data());
    for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
    sink_.add(name, DType::kBF16, std::move(shape), std::move(b));
  }
  void raw(const std::string& name, DType t, std::vector<int64_t> shape, std::vector<uint8_t> v) {
    if (recording_) repeat_.insert(name);
    sink_.add(name, t, std::move(shape), std::move(v));
  }
  void f32(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * sizeof(float));
    std::memcpy(b.data(), v.data(), b.size());
    raw(name, DType::kF32, std::move(shape), std::move(b));
  }
  // Normal weights with std gain / sqrt(fan_in), in FP8 with 128x128 UE8M0 scales.
  void fp8_linear(const std::string& name, int out, int in, double gain) {
    Fp8Weight q = quantize_fp8_weight(gaussian(size_t(out) * in, gain / std::sqrt(in)), out, in);
    raw(name + ".weight", DType::kF8E4M3, {out, in}, std::move(q.codes));
    raw(name + ".scale", DType::kF8E8M0, {(out + 127) / 128, (in + 127) / 128},
        std::move(q.scales));
  }
  void bf16_linear(const std::string& name, int out, int in, double gain) {
    bf16(name, {out, in}, gaussian(size_t(out) * in, gain / std::sqrt(in)));
  }
  void norm(const std::string& name, int n) {
    std::vector<float> v = gaussian(n, 0.1);
    for (float& x : v) x += 1.0f;
    bf16(name, {n}, v);
  }
  // One routed expert (w1, w3 [inter, dim]; w2 [dim, inter]). With repeat_experts, expert e > 0
  // of a block is an alias of expert 0's tensors (`first`: the names of expert 0's,
  // "...experts.0."), in name order.
  void expert(const std::string& p, int dim, int inter, const std::string& first) {
    if (init_.repeat_experts && p != first) {
      for (const std::string& name : repeat_) sink_.alias(p + name.substr(first.size()), name);
      if (fmt_ == ExpertFormat::kNvfp4)
        for (const char* w : {"w1", "w2", "w3"}) quantized_.push_back(p + w);
      return;
    }
    recording_ = init_.repeat_experts;
    repeat_.clear();
    generate_expert(p, dim, inter);
    recording_ = false;
  }
  void generate_expert(const std::string& p, int dim, int inter) {
    std::vector<float> w1 = gaussian(size_t(inter) * dim, init_.expert_in / std::sqrt(dim));
    std::vector<float> w3 = gaussian(size_t(inter) * dim, init_.expert_in / std::sqrt(dim));
    std::vector<float> w2 =
        gaussian(size_t(dim) * inter, kRho * init_.routed_out_coef / std::sqrt(inter));
    if (fmt_ == ExpertFormat::kMxfp4) {
      auto put = [&](const std::string& n, const std::vector<float>& w, int out, int in) {
        Mxfp4Weight q = quantize_mxfp4_weight(w, out, in);
        raw(n + ".weight", DType::kI8, {out, in / 2}, std::move(q.packed));
        raw(n + ".scale", DType::kF8E8M0, {out, in / 32}, std::move(q.scales));
      };
      put(p + "w1", w1, inter, dim);
      put(p + "w3", w3, inter, dim);
      put(p + "w2", w2, dim, inter);
      return;
    }
    // ModelOpt: w1 and w3 share the global scale (max of both) so GEMM1 can be fused.
    const float s13 = std::max(nvfp4_global_scale(w1), nvfp4_global_scale(w3));
    const float in_scale = kNvfp4InputAmax / (kE2m1Max * kE4m3Max);
    auto put = [&](const std::string& n, const std::vector<float>& w, int out, int in, float s2) {
      Nvfp4Weight q = quantize_nvfp4_weight(w, out, in, s2);
      raw(n + ".weight", DType::kU8, {out, in / 2}, std::move(q.packed));
      raw(n + ".weight_scale", DType::kF8E4M3, {out, in / 16}, std::move(q.scales));
      f32(n + ".weight_scale_2", {}, {q.scale_2});
      f32(n + ".input_scale", {}, {in_scale});
      quantized_.push_back(n);
    };
    put(p + "w1", w1, inter, dim, s13);
    put(p + "w3", w3, inter, dim, s13);
    put(p + "w2", w2, dim, inter, nvfp4_global_scale(w2));
  }
  void hc(const std::string& prefix, int rows, int width, int hc, bool head) {
    f32(prefix + "_fn", {rows, width}, gaussian(size_t(rows) * width, 1.0 / std::sqrt(width)));
    std::vector<float> base = gaussian(rows, 0.5);
    if (!head)
      for (int j = 0; j < hc; ++j) base[2 * hc + j * hc + j] += 2.0f;  // comb favours identity
    f32(prefix + "_base", {rows}, base);
    if (head) {
      f32(prefix + "_scale", {1}, {0.5f});
    } else {
      std::vector<float> s(3);
      for (auto& x : s) x = static_cast<float>(rng_.uniform(0.2, 0.8));
      f32(prefix + "_scale", {3}, s);
    }
  }
  void compressor(const std::string& p, int ratio, int d, int dim) {
    const int coff = ratio == 4 ? 2 : 1;
    bf16_linear(p + "wkv.weight", coff * d, dim, 1.0);
    bf16_linear(p + "wgate.weight", coff * d, dim, 1.0);
    f32(p + "ape", {ratio, coff * d}, gaussian(size_t(ratio) * coff * d, 0.5));
    norm(p + "norm.weight", d);
  }

  Rng& rng() { return rng_; }
  void next_shard() { sink_.next_shard(); }
  const std::vector<std::string>& quantized() const { return quantized_; }

 private:
  Rng rng_;
  ExpertFormat fmt_;
  TinyInit init_;
  TensorSink& sink_;
  std::set<std::string> repeat_;  // expert 0's tensor names of the block (repeat_experts)
  bool recording_ = false;        // generating expert 0 with repeat_experts
  std::vector<std::string> quantized_;
};

// The file sink: sharded safetensors and their index (an alias is written as a copy).
class ShardedWriter final : public TensorSink {
 public:
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape,
           std::vector<uint8_t> bytes) override {
    shard().add(name, dtype, shape, bytes.data(), bytes.size());
    index_[name] = {current_, dtype, std::move(shape)};
  }
  void alias(const std::string& name, const std::string& of) override {
    const Placed& p = index_.at(of);
    std::vector<uint8_t> b = shards_[p.shard].bytes(of);
    add(name, p.dtype, p.shape, std::move(b));
  }
  void next_shard() override { ++current_; }

  void write(const std::string& dir) {
    const int n = current_ + 1;
    nlohmann::ordered_json idx;
    size_t total = 0;
    for (int i = 0; i < n; ++i) total += shards_[i].total_bytes();
    idx["metadata"] = {{"total_size", total}};
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    for (const auto& [name, p] : index_) map[name] = shard_name(p.shard, n);
    idx["weight_map"] = map;
    for (int i = 0; i < n; ++i) shards_[i].write((fs::path(dir) / shard_name(i, n)).string());
    std::ofstream(fs::path(dir) / "model.safetensors.index.json") << idx.dump(2) << "\n";
  }

 private:
  SafetensorsWriter& shard() {
    if (int(shards_.size()) <= current_) shards_.resize(current_ + 1);
    return shards_[current_];
  }
  static std::string shard_name(int i, int n) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", i + 1, n);
    return buf;
  }

  struct Placed {
    int shard;
    DType dtype;
    std::vector<int64_t> shape;
  };
  std::vector<SafetensorsWriter> shards_;
  std::map<std::string, Placed> index_;
  int current_ = 0;
};

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream os(p);
  DSV4_CHECK(os.good(), p.string(), ": cannot write");
  os << text;
  DSV4_CHECK(os.good(), p.string(), ": write failed");
}

}  // namespace

ModelConfig tiny_preset(const std::string& preset) {
  ModelConfig c;
  c.vocab_size = 2048;
  c.dim = 256;
  c.n_mtp_layers = 1;
  c.head_dim = 512;
  c.rope_head_dim = 64;
  c.q_lora_rank = 128;
  c.o_lora_rank = 128;
  c.window_size = 128;
  c.index_head_dim = 128;
  c.rope_theta = 10000;
  c.compress_rope_theta = 160000;
  c.rope_factor = 16;
  c.original_seq_len = 65536;
  c.beta_fast = 32;
  c.beta_slow = 1;
  c.norm_eps = 1e-6f;
  c.hc_mult = 4;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6f;
  c.n_shared_experts = 1;
  c.moe_inter_dim = 128;
  c.score_func = ScoreFunc::kSqrtSoftplus;
  c.swiglu_limit = 10.0f;
  c.bos_token_id = 0;
  c.eos_token_id = 1;
  c.max_position_embeddings = 1048576;
  if (preset == "flash") {
    c.n_layers = 6;
    c.compress_ratios = {0, 128, 4, 4, 128, 0, 0};
    c.n_hash_layers = 2;
    c.n_heads = 4;
    c.o_groups = 2;
    c.index_n_heads = 8;
    c.index_topk = 8;
    c.n_routed_experts = 16;
    c.n_activated_experts = 4;
    c.route_scale = 1.5f;
  } else if (preset == "pro") {
    c.n_layers = 5;
    c.compress_ratios = {128, 128, 4, 128, 4, 0};
    c.n_hash_layers = 3;
    c.n_heads = 8;
    c.o_groups = 4;
    c.index_n_heads = 16;
    c.index_topk = 16;
    c.n_routed_experts = 24;
    c.n_activated_experts = 6;
    c.route_scale = 2.5f;
  } else {
    throw Error(cat("unknown preset '", preset, "' (flash, pro)"));
  }
  c.validate();
  return c;
}

ModelConfig first_layers(const ModelConfig& config, int layers) {
  DSV4_CHECK(layers >= 1 && layers <= config.n_layers, "layers must be in [1, ", config.n_layers,
             "], got ", layers);
  ModelConfig c = config;
  c.n_layers = layers;
  c.n_mtp_layers = 0;
  c.compress_ratios.resize(size_t(layers));
  c.n_hash_layers = std::min(c.n_hash_layers, layers);
  c.validate();
  return c;
}

TinyInit tiny_init(const std::string& preset) {
  TinyInit i;
  if (preset == "pro") {
    i.head = 4.0;
    i.expert_in = 4.0;
    i.routed_out_coef = 0.0625;
  }
  return i;
}

namespace {

// Every tensor of the checkpoint of `c` (its experts in `format`) into `sink`, in the order
// the file writer lays them out. Returns the NVFP4-quantised modules (hf_quant_config.json).
std::vector<std::string> generate_tensors(const ModelConfig& c, ExpertFormat format, uint64_t seed,
                                          const TinyInit& init, TensorSink& sink) {
  Generator w(seed, format, init, sink);
  const int dim = c.dim, hc_dim = c.hc_mult * c.dim, mix = c.mix_hc();
  w.bf16("embed.weight", {c.vocab_size, dim}, w.gaussian(size_t(c.vocab_size) * dim, 1.0));
  w.bf16_linear("head.weight", c.vocab_size, dim, init.head);
  w.norm("norm.weight", dim);
  w.hc("hc_head", c.hc_mult, hc_dim, c.hc_mult, true);
  for (int b = 0; b < c.num_blocks(); ++b) {
    if (b > 0 && b % 2 == 0) w.next_shard();  // several shards, exercised by the loader
    const std::string p = block_prefix(c, b);
    const int ratio = c.ratio(b), H = c.n_heads, D = c.head_dim;
    w.hc(p + "hc_attn", mix, hc_dim, c.hc_mult, false);
    w.hc(p + "hc_ffn", mix, hc_dim, c.hc_mult, false);
    w.norm(p + "attn_norm.weight", dim);
    w.norm(p + "ffn_norm.weight", dim);
    w.fp8_linear(p + "attn.wq_a", c.q_lora_rank, dim, 1.0);
    w.norm(p + "attn.q_norm.weight", c.q_lora_rank);
    w.fp8_linear(p + "attn.wq_b", H * D, c.q_lora_rank, 1.0);
    w.fp8_linear(p + "attn.wkv", D, dim, 1.0);
    w.norm(p + "attn.kv_norm.weight", D);
    w.fp8_linear(p + "attn.wo_a", c.o_groups * c.o_lora_rank, H * D / c.o_groups, 1.0);
    w.fp8_linear(p + "attn.wo_b", dim, c.o_groups * c.o_lora_rank, kRho * kAttnOutCoef);
    std::vector<float> sink(H);
    for (auto& s : sink) s = static_cast<float>(w.rng().uniform(-1.0, 4.0));
    w.f32(p + "attn.attn_sink", {H}, sink);
    if (ratio > 0) w.compressor(p + "attn.compressor.", ratio, D, dim);
    if (ratio == 4) {
      w.fp8_linear(p + "attn.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, 1.0);
      w.bf16_linear(p + "attn.indexer.weights_proj.weight", c.index_n_heads, dim, 1.0);
      w.compressor(p + "attn.indexer.compressor.", 4, c.index_head_dim, dim);
    }
    w.bf16_linear(p + "ffn.gate.weight", c.n_routed_experts, dim, 1.5);
    if (c.is_hash_layer(b)) {
      std::vector<int64_t> t(size_t(c.vocab_size) * c.n_activated_experts);
      for (int v = 0; v < c.vocab_size; ++v) {
        std::vector<int64_t> e(c.n_routed_experts);
        for (int i = 0; i < c.n_routed_experts; ++i) e[i] = i;
        for (int i = 0; i < c.n_activated_experts; ++i) {  // distinct experts per token
          std::swap(e[i], e[i + w.rng().below(c.n_routed_experts - i)]);
          t[size_t(v) * c.n_activated_experts + i] = e[i];
        }
      }
      std::vector<uint8_t> bytes(t.size() * 8);
      std::memcpy(bytes.data(), t.data(), bytes.size());
      w.raw(p + "ffn.gate.tid2eid", DType::kI64, {c.vocab_size, c.n_activated_experts}, bytes);
    } else {
      w.f32(p + "ffn.gate.bias", {c.n_routed_experts}, w.gaussian(c.n_routed_experts, 0.1));
    }
    for (int e = 0; e < c.n_routed_experts; ++e)
      w.expert(cat(p, "ffn.experts.", e, "."), dim, c.moe_inter_dim, cat(p, "ffn.experts.0."));
    w.fp8_linear(p + "ffn.shared_experts.w1", c.moe_inter_dim, dim, 1.0);
    w.fp8_linear(p + "ffn.shared_experts.w3", c.moe_inter_dim, dim, 1.0);
    w.fp8_linear(p + "ffn.shared_experts.w2", dim, c.moe_inter_dim, kRho * kSharedOutCoef);
    if (b >= c.n_layers) {
      w.fp8_linear(p + "e_proj", dim, dim, 1.0);
      w.fp8_linear(p + "h_proj", dim, dim, 1.0);
      w.norm(p + "enorm.weight", dim);
      w.norm(p + "hnorm.weight", dim);
      w.norm(p + "norm.weight", dim);
      w.hc(p + "hc_head", c.hc_mult, hc_dim, c.hc_mult, true);
    }
  }
  return w.quantized();
}

// The config a checkpoint of `config` in `format` declares.
ModelConfig declared_config(const ModelConfig& config, ExpertFormat format) {
  ModelConfig c = config;
  c.moe_quant_algo = format == ExpertFormat::kNvfp4 ? "NVFP4" : "";
  c.validate();
  return c;
}

}  // namespace

void write_tiny_checkpoint(const ModelConfig& config, ExpertFormat format, uint64_t seed,
                           const std::string& dir, const TinyInit& init) {
  const ModelConfig c = declared_config(config, format);
  DSV4_CHECK(!fs::exists(dir) || fs::is_directory(dir), dir, ": exists and is not a directory");
  fs::create_directories(dir);

  ShardedWriter files;
  const std::vector<std::string> quantized = generate_tensors(c, format, seed, init, files);
  files.write(dir);
  write_text(fs::path(dir) / "config.json", model_config_to_json(c));
  write_text(fs::path(dir) / "generation_config.json",
             "{\n  \"bos_token_id\": 0,\n  \"eos_token_id\": 1,\n  \"temperature\": 1.0,\n"
             "  \"top_p\": 1.0\n}\n");
  if (format == ExpertFormat::kNvfp4) {
    nlohmann::ordered_json layers = nlohmann::ordered_json::object();
    for (const auto& m : quantized) layers[m] = {{"quant_algo", "NVFP4"}, {"group_size", 16}};
    nlohmann::ordered_json q;
    q["producer"] = {{"name", "modelopt"}, {"version", "dsv4-nvfp4-experts"}};
    q["quantization"] = {{"quant_algo", "MIXED_PRECISION"},
                         {"kv_cache_quant_algo", nullptr},
                         {"group_size", 16},
                         {"quantized_layers", layers},
                         {"exclude_modules",
                          {"*.attn.*", "*.attn_norm.*", "*.ffn.shared_experts.*", "*.ffn.gate.*",
                           "*.ffn_norm.*", "embed.weight", "head.weight", "*.hc_*", "*.h_proj.*",
                           "*.e_proj.*", "*.enorm.*", "*.hnorm.*", "mtp.*.norm.*", "norm.weight"}}};
    write_text(fs::path(dir) / "hf_quant_config.json", q.dump(2) + "\n");
  } else {
    fs::remove(fs::path(dir) / "hf_quant_config.json");  // a stale one would claim NVFP4
  }
}

TinyModel make_tiny_model(const ModelConfig& config, ExpertFormat format, uint64_t seed,
                          const TinyInit& init) {
  const ModelConfig c = declared_config(config, format);
  TinyModel m;
  // The config as loading the written config.json gives it (same numbers, bit for bit).
  m.config = parse_model_config(model_config_to_json(c), "random weights");
  m.scheme = QuantScheme::of_config(m.config);
  auto store = std::make_shared<TensorStore>();
  generate_tensors(c, format, seed, init, *store);
  m.tensors = std::move(store);
  return m;
}

}  // namespace dsv4
