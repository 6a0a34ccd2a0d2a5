// The model's hyper-parameters, validated. Nothing in the engine is specific to the
// released Flash/Pro sizes: every loop bound comes from here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ops/common/score_func.h"

namespace dsv4 {

struct ModelConfig {
  int vocab_size = 0;
  int dim = 0;
  int n_layers = 0;
  int n_mtp_layers = 0;
  int n_heads = 0;
  int head_dim = 0;
  int rope_head_dim = 0;
  int q_lora_rank = 0;
  int o_groups = 0;
  int o_lora_rank = 0;
  int window_size = 0;
  std::vector<int> compress_ratios;  // n_layers + n_mtp_layers entries (MTP last)
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  double rope_theta = 0;
  double compress_rope_theta = 0;
  double rope_factor = 1;
  int64_t original_seq_len = 0;  // YaRN on compressed layers iff > 0
  double beta_fast = 32;
  double beta_slow = 1;
  float norm_eps = 1e-6f;
  int hc_mult = 0;
  int hc_sinkhorn_iters = 0;
  float hc_eps = 1e-6f;
  int n_routed_experts = 0;
  int n_shared_experts = 0;
  int n_activated_experts = 0;
  int moe_inter_dim = 0;
  int n_hash_layers = 0;
  ScoreFunc score_func = ScoreFunc::kSqrtSoftplus;
  float route_scale = 1;
  float swiglu_limit = 0;
  int bos_token_id = 0;
  int eos_token_id = 1;
  int64_t max_position_embeddings = 0;
  std::string moe_quant_algo;  // "" (native MXFP4) or "NVFP4" (ModelOpt)

  int nope_head_dim() const { return head_dim - rope_head_dim; }
  int num_blocks() const { return n_layers + n_mtp_layers; }
  int ratio(int block) const { return compress_ratios.at(block); }
  bool is_hash_layer(int block) const { return block < n_hash_layers; }
  int mix_hc() const { return (2 + hc_mult) * hc_mult; }
  int heads_per_group() const { return n_heads / o_groups; }

  // Throws dsv4::Error naming the first field outside its bounds (config_bounds()) or
  // inconsistent with another.
  void validate() const;
};

// The documented bounds of every numeric config.json field (README, "Config bounds"). They are
// generous for any DeepSeek-V4 geometry (the released Flash and Pro values sit far inside) and
// finite, so that no value can make a loop or an allocation explode before the memory plan
// weighs it. The parser reads each value into its full range first, so nothing wraps around.
struct ConfigBound {
  const char* key;  // the config.json key ("rope_scaling.factor" for nested ones)
  double min, max;
  bool min_exclusive = false;  // (min, max] rather than [min, max]
};
const std::vector<ConfigBound>& config_bounds();
// The bound of `key` (which must be in the table).
const ConfigBound& config_bound(std::string_view key);
bool within(const ConfigBound& b, double value);
// "[1, 1024]" or "(0, 1]"
std::string bound_text(const ConfigBound& b);
// The allowed entries of compress_ratios.
constexpr int kCompressRatios[] = {0, 4, 128};

// Reads a Hugging Face config.json (DeepseekV4ForCausalLM). Unknown architecture or a
// missing field is an error naming the file and field.
ModelConfig load_model_config(const std::string& config_json_path);
ModelConfig parse_model_config(const std::string& json_text, const std::string& origin);

}  // namespace dsv4

namespace dsv4 {
// The Hugging Face config.json text for a config (the inverse of parse_model_config).
std::string model_config_to_json(const ModelConfig& c);
}  // namespace dsv4
