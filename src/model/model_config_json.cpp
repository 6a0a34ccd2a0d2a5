// config.json -> ModelConfig.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/excerpt.h"
#include "io/json_keys.h"
#include "model/model_config.h"

namespace dsv4 {
namespace {

using nlohmann::json;

class Reader {
 public:
  // `prefix`: the object's path for nested objects ("rope_scaling."), "" for the top level.
  Reader(const json& j, const std::string& origin, std::string prefix = "")
      : j_(j), origin_(origin), prefix_(std::move(prefix)) {}

  const json& field(const char* key) const {
    DSV4_CHECK(j_.contains(key), origin_, ": missing field '", prefix_, key, "'");
    return j_.at(key);
  }
  // An integer within the field's documented bound (config_bounds()), read over the whole
  // JSON range first so that nothing wraps around on the way to int.
  int64_t integer(const char* key) const {
    const json& v = field(key);
    const ConfigBound& b = config_bound(prefix_ + key);
    DSV4_CHECK(v.is_number_integer(), origin_, ": field '", prefix_, key,
               "' must be an integer, got ", excerpt(v.dump()));
    const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(b.max)
                                             : within(b, double(v.get<int64_t>()));
    DSV4_CHECK(fits && within(b, v.get<double>()), origin_, ": field '", prefix_, key,
               "' = ", v.dump(), " is out of range ", bound_text(b));
    return v.get<int64_t>();
  }
  int i32(const char* key) const { return static_cast<int>(integer(key)); }
  // A finite number within the field's documented bound.
  double number(const char* key) const {
    const json& v = field(key);
    DSV4_CHECK(v.is_number(), origin_, ": field '", prefix_, key, "' must be a number, got ",
               excerpt(v.dump()));
    const ConfigBound& b = config_bound(prefix_ + key);
    DSV4_CHECK(within(b, v.get<double>()), origin_, ": field '", prefix_, key, "' = ", v.dump(),
               " is out of range ", bound_text(b));
    return v.get<double>();
  }
  // number() for a field held as float: the rounded value must be within the bound too
  // (1e-50 would become 0).
  float f32(const char* key) const {
    const double v = number(key);
    const auto f = static_cast<float>(v);
    DSV4_CHECK(within(config_bound(prefix_ + key), f), origin_, ": field '", prefix_, key,
               "' = ", field(key).dump(), " is out of range ",
               bound_text(config_bound(prefix_ + key)), " once rounded to float (", f, ")");
    return f;
  }
  std::string str(const char* key) const {
    const json& v = field(key);
    DSV4_CHECK(v.is_string(), origin_, ": field '", prefix_, key, "' must be a string");
    return v.get<std::string>();
  }

 private:
  const json& j_;
  const std::string& origin_;
  std::string prefix_;
};

}  // namespace

ModelConfig parse_model_config(const std::string& text, const std::string& origin) {
  json j;
  DuplicateKey dup;
  try {
    j = parse_json_noting_duplicates(text, &dup);
  } catch (const json::exception& e) {
    throw Error(cat(origin, ": not valid JSON: ", parser_message(e.what())));
  }
  DSV4_CHECK(j.is_object(), origin, ": not a JSON object");
  DSV4_CHECK(dup.key.empty(), origin, ": field ", excerpt(dup.key),
             " is given twice (which one is meant?)");
  Reader r(j, origin);

  bool known = false;
  if (j.contains("architectures") && j["architectures"].is_array())
    for (const auto& a : j["architectures"])
      if (a.is_string() && a.get<std::string>() == "DeepseekV4ForCausalLM") known = true;
  if (!known) {
    std::string arch = j.contains("architectures") ? j["architectures"].dump() : "(none)";
    std::string type = j.contains("model_type") ? j["model_type"].dump() : "(none)";
    throw Error(cat(origin, ": unsupported architecture ", excerpt(arch), " (model_type ",
                    excerpt(type), "); dsv4 runs DeepseekV4ForCausalLM"));
  }

  ModelConfig c;
  c.vocab_size = r.i32("vocab_size");
  c.dim = r.i32("hidden_size");
  c.n_layers = r.i32("num_hidden_layers");
  c.n_mtp_layers = r.i32("num_nextn_predict_layers");
  c.n_heads = r.i32("num_attention_heads");
  r.integer("num_key_value_heads");  // 1: one shared KV latent
  c.head_dim = r.i32("head_dim");
  c.rope_head_dim = r.i32("qk_rope_head_dim");
  c.q_lora_rank = r.i32("q_lora_rank");
  c.o_groups = r.i32("o_groups");
  c.o_lora_rank = r.i32("o_lora_rank");
  c.window_size = r.i32("sliding_window");
  const json& ratios = r.field("compress_ratios");
  DSV4_CHECK(ratios.is_array(), origin, ": field 'compress_ratios' must be a list");
  for (size_t i = 0; i < ratios.size(); ++i) {
    const json& v = ratios[i];
    bool ok = false;
    for (int allowed : kCompressRatios)
      ok |= v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > 128) &&
            v.get<int64_t>() == allowed;
    DSV4_CHECK(ok, origin, ": compress_ratios[", i,
               "] = ", v.is_number() ? v.dump() : excerpt(v.dump()),
               " is not supported (0, 4 or 128)");
    c.compress_ratios.push_back(v.get<int>());
  }
  c.index_n_heads = r.i32("index_n_heads");
  c.index_head_dim = r.i32("index_head_dim");
  c.index_topk = r.i32("index_topk");
  c.rope_theta = r.number("rope_theta");
  c.compress_rope_theta = r.number("compress_rope_theta");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const json& rs = j["rope_scaling"];
    DSV4_CHECK(rs.is_object(), origin, ": 'rope_scaling' must be an object");
    Reader s(rs, origin, "rope_scaling.");
    std::string type = rs.contains("type") ? s.str("type") : s.str("rope_type");
    DSV4_CHECK(type == "yarn", origin, ": rope_scaling type ", excerpt(type),
               " is not supported (yarn)");
    c.rope_factor = s.number("factor");
    c.original_seq_len = s.integer("original_max_position_embeddings");
    c.beta_fast = s.number("beta_fast");
    c.beta_slow = s.number("beta_slow");
  }
  c.norm_eps = r.f32("rms_norm_eps");
  c.hc_mult = r.i32("hc_mult");
  c.hc_sinkhorn_iters = r.i32("hc_sinkhorn_iters");
  c.hc_eps = r.f32("hc_eps");
  c.n_routed_experts = r.i32("n_routed_experts");
  c.n_shared_experts = r.i32("n_shared_experts");
  c.n_activated_experts = r.i32("num_experts_per_tok");
  c.moe_inter_dim = r.i32("moe_intermediate_size");
  c.n_hash_layers = r.i32("num_hash_layers");
  const std::string sf = r.str("scoring_func");
  if (sf == "sqrtsoftplus")
    c.score_func = ScoreFunc::kSqrtSoftplus;
  else if (sf == "softmax")
    c.score_func = ScoreFunc::kSoftmax;
  else if (sf == "sigmoid")
    c.score_func = ScoreFunc::kSigmoid;
  else
    throw Error(cat(origin, ": unsupported scoring_func ", excerpt(sf),
                    " (sqrtsoftplus, softmax, sigmoid)"));
  if (j.contains("topk_method")) {
    std::string tm = r.str("topk_method");
    DSV4_CHECK(tm == "noaux_tc", origin, ": unsupported topk_method ", excerpt(tm), " (noaux_tc)");
  }
  if (j.contains("norm_topk_prob"))
    DSV4_CHECK(j["norm_topk_prob"].is_boolean() && j["norm_topk_prob"].get<bool>(), origin,
               ": norm_topk_prob must be true");
  c.route_scale = r.f32("routed_scaling_factor");
  c.swiglu_limit = r.f32("swiglu_limit");
  c.bos_token_id = r.i32("bos_token_id");
  c.eos_token_id = r.i32("eos_token_id");
  c.max_position_embeddings = r.integer("max_position_embeddings");

  const json& q = r.field("quantization_config");
  DSV4_CHECK(q.is_object(), origin, ": 'quantization_config' must be an object");
  Reader qr(q, origin, "quantization_config.");
  DSV4_CHECK(qr.str("quant_method") == "fp8", origin,
             ": quantization_config.quant_method must be 'fp8'");
  if (q.contains("fmt"))
    DSV4_CHECK(qr.str("fmt") == "e4m3", origin, ": quantization_config.fmt must be 'e4m3'");
  const json& bs = qr.field("weight_block_size");
  DSV4_CHECK(bs.is_array() && bs.size() == 2 && bs[0] == 128 && bs[1] == 128, origin,
             ": quantization_config.weight_block_size must be [128, 128]");
  if (q.contains("scale_fmt"))
    DSV4_CHECK(qr.str("scale_fmt") == "ue8m0", origin,
               ": quantization_config.scale_fmt must be 'ue8m0'");
  if (q.contains("moe_quant_algo")) {
    c.moe_quant_algo = qr.str("moe_quant_algo");
    DSV4_CHECK(c.moe_quant_algo == "NVFP4" || c.moe_quant_algo == "MXFP4", origin,
               ": unsupported moe_quant_algo ", excerpt(c.moe_quant_algo), " (MXFP4, NVFP4)");
    if (c.moe_quant_algo == "MXFP4") c.moe_quant_algo.clear();
  }
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(cat(origin, ": ", e.what()));
  }
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  std::ifstream is(path);
  DSV4_CHECK(is.good(), path, ": cannot open config");
  std::stringstream ss;
  ss << is.rdbuf();
  return parse_model_config(ss.str(), path);
}

}  // namespace dsv4

namespace dsv4 {

std::string model_config_to_json(const ModelConfig& c) {
  nlohmann::ordered_json j;
  j["architectures"] = {"DeepseekV4ForCausalLM"};
  j["model_type"] = "deepseek_v4";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.dim;
  j["num_hidden_layers"] = c.n_layers;
  j["num_nextn_predict_layers"] = c.n_mtp_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = 1;
  j["head_dim"] = c.head_dim;
  j["qk_rope_head_dim"] = c.rope_head_dim;
  j["q_lora_rank"] = c.q_lora_rank;
  j["o_groups"] = c.o_groups;
  j["o_lora_rank"] = c.o_lora_rank;
  j["sliding_window"] = c.window_size;
  j["compress_ratios"] = c.compress_ratios;
  j["index_n_heads"] = c.index_n_heads;
  j["index_head_dim"] = c.index_head_dim;
  j["index_topk"] = c.index_topk;
  j["rope_theta"] = c.rope_theta;
  j["compress_rope_theta"] = c.compress_rope_theta;
  if (c.original_seq_len > 0)
    j["rope_scaling"] = {{"type", "yarn"},
                         {"factor", c.rope_factor},
                         {"original_max_position_embeddings", c.original_seq_len},
                         {"beta_fast", c.beta_fast},
                         {"beta_slow", c.beta_slow}};
  j["rms_norm_eps"] = c.norm_eps;
  j["hc_mult"] = c.hc_mult;
  j["hc_sinkhorn_iters"] = c.hc_sinkhorn_iters;
  j["hc_eps"] = c.hc_eps;
  j["n_routed_experts"] = c.n_routed_experts;
  j["n_shared_experts"] = c.n_shared_experts;
  j["num_experts_per_tok"] = c.n_activated_experts;
  j["moe_intermediate_size"] = c.moe_inter_dim;
  j["num_hash_layers"] = c.n_hash_layers;
  j["scoring_func"] = c.score_func == ScoreFunc::kSqrtSoftplus ? "sqrtsoftplus"
                      : c.score_func == ScoreFunc::kSoftmax    ? "softmax"
                                                               : "sigmoid";
  j["topk_method"] = "noaux_tc";
  j["norm_topk_prob"] = true;
  j["routed_scaling_factor"] = c.route_scale;
  j["swiglu_limit"] = c.swiglu_limit;
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_id;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["tie_word_embeddings"] = false;
  j["torch_dtype"] = "bfloat16";
  nlohmann::ordered_json q = {{"activation_scheme", "dynamic"},
                              {"fmt", "e4m3"},
                              {"quant_method", "fp8"},
                              {"scale_fmt", "ue8m0"},
                              {"weight_block_size", {128, 128}}};
  if (!c.moe_quant_algo.empty()) q["moe_quant_algo"] = c.moe_quant_algo;
  j["quantization_config"] = q;
  return j.dump(2) + "\n";
}

}  // namespace dsv4
