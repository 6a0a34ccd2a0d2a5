#include "model/model_config.h"

#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace dsv4 {
namespace {

constexpr double kTokens = 1 << 30;  // positions are int32 with headroom for sums

// Keep in step with README's "Config bounds" table (cli_test checks that it lists these).
// Flash / Pro values (spec §1.1) in the comments.
const std::vector<ConfigBound> kBounds = {
    {"vocab_size", 1, 1 << 24},                                     // 129280
    {"hidden_size", 128, 65536},                                    // 4096 / 7168
    {"num_hidden_layers", 1, 1024},                                 // 43 / 61
    {"num_nextn_predict_layers", 0, 16},                            // 1
    {"num_attention_heads", 1, 1024},                               // 64 / 128
    {"num_key_value_heads", 1, 1},                                  // one shared KV latent
    {"head_dim", 64, 8192},                                         // 512
    {"qk_rope_head_dim", 2, 1024},                                  // 64
    {"q_lora_rank", 128, 65536},                                    // 1024 / 1536
    {"o_groups", 1, 1024},                                          // 8 / 16
    {"o_lora_rank", 1, 65536},                                      // 1024
    {"sliding_window", 1, kTokens},                                 // 128
    {"index_n_heads", 0, 1024},                                     // 64 (positive with CSA layers)
    {"index_head_dim", 0, 4096},                                    // 128
    {"index_topk", 0, 1 << 20},                                     // 512 / 1024
    {"rope_theta", 1, 1e12, true},                                  // 10000
    {"compress_rope_theta", 1, 1e12, true},                         // 160000
    {"rope_scaling.factor", 0, 1e6, true},                          // 16
    {"rope_scaling.original_max_position_embeddings", 1, kTokens},  // 65536
    {"rope_scaling.beta_fast", 0, 1e6, true},                       // 32
    {"rope_scaling.beta_slow", 0, 1e6, true},                       // 1
    {"max_position_embeddings", 1, kTokens},                        // 1048576
    {"rms_norm_eps", 0, 1, true},                                   // 1e-6
    {"hc_mult", 1, 64},                                             // 4
    {"hc_sinkhorn_iters", 1, 1000},                                 // 20
    {"hc_eps", 0, 1, true},                                         // 1e-6
    {"n_routed_experts", 1, 4096},                                  // 256 / 384
    {"n_shared_experts", 1, 1},                                     // 1 (as in the reference)
    {"num_experts_per_tok", 1, 4096},                               // 6
    {"moe_intermediate_size", 128, 262144},                         // 2048 / 3072
    {"num_hash_layers", 0, 1024},                                   // 3
    {"routed_scaling_factor", 0, 1000, true},                       // 1.5 / 2.5
    {"swiglu_limit", 0, 1e6},                                       // 10 (0: no clamp)
    {"bos_token_id", 0, (1 << 24) - 1},                             // 0
    {"eos_token_id", 0, (1 << 24) - 1},                             // 1
};

std::string number_text(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e18)
    return std::to_string(static_cast<long long>(v));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

}  // namespace

const std::vector<ConfigBound>& config_bounds() {
  return kBounds;
}

const ConfigBound& config_bound(std::string_view key) {
  for (const ConfigBound& b : kBounds)
    if (key == b.key) return b;
  throw Error(cat("no documented bound for config field '", key, "'"));
}

bool within(const ConfigBound& b, double v) {
  return std::isfinite(v) && (b.min_exclusive ? v > b.min : v >= b.min) && v <= b.max;
}

std::string bound_text(const ConfigBound& b) {
  return cat(b.min_exclusive ? "(" : "[", number_text(b.min), ", ", number_text(b.max), "]");
}

void ModelConfig::validate() const {
  auto in = [](const char* key, double v) {
    const ConfigBound& b = config_bound(key);
    DSV4_CHECK(within(b, v), key, " = ", number_text(v), " is out of range ", bound_text(b));
  };
  in("vocab_size", vocab_size);
  in("hidden_size", dim);
  in("num_hidden_layers", n_layers);
  in("num_nextn_predict_layers", n_mtp_layers);
  in("num_attention_heads", n_heads);
  in("head_dim", head_dim);
  in("qk_rope_head_dim", rope_head_dim);
  in("q_lora_rank", q_lora_rank);
  in("o_groups", o_groups);
  in("o_lora_rank", o_lora_rank);
  in("sliding_window", window_size);
  in("index_n_heads", index_n_heads);
  in("index_head_dim", index_head_dim);
  in("index_topk", index_topk);
  in("rope_theta", rope_theta);
  in("compress_rope_theta", compress_rope_theta);
  in("rope_scaling.factor", rope_factor);
  if (original_seq_len > 0) in("rope_scaling.original_max_position_embeddings", original_seq_len);
  DSV4_CHECK(original_seq_len >= 0, "original_max_position_embeddings must be >= 0");
  in("rope_scaling.beta_fast", beta_fast);
  in("rope_scaling.beta_slow", beta_slow);
  in("max_position_embeddings", double(max_position_embeddings));
  in("rms_norm_eps", norm_eps);
  in("hc_mult", hc_mult);
  in("hc_sinkhorn_iters", hc_sinkhorn_iters);
  in("hc_eps", hc_eps);
  in("n_routed_experts", n_routed_experts);
  in("n_shared_experts", n_shared_experts);
  in("num_experts_per_tok", n_activated_experts);
  in("moe_intermediate_size", moe_inter_dim);
  in("num_hash_layers", n_hash_layers);
  in("routed_scaling_factor", route_scale);
  in("swiglu_limit", swiglu_limit);
  in("bos_token_id", bos_token_id);
  in("eos_token_id", eos_token_id);

  // FP8 activation quantisation works on whole 128-wide blocks of every GEMM input.
  DSV4_CHECK(dim % 128 == 0, "hidden_size ", dim, " must be a multiple of 128");
  DSV4_CHECK(q_lora_rank % 128 == 0, "q_lora_rank must be a multiple of 128");
  DSV4_CHECK(moe_inter_dim % 128 == 0, "moe_intermediate_size must be a multiple of 128");
  DSV4_CHECK((int64_t(o_groups) * o_lora_rank) % 128 == 0,
             "o_groups*o_lora_rank must be a multiple of 128");
  DSV4_CHECK(rope_head_dim % 2 == 0 && rope_head_dim < head_dim,
             "qk_rope_head_dim must be even and smaller than head_dim");
  DSV4_CHECK(nope_head_dim() % 64 == 0,
             "head_dim - qk_rope_head_dim must be a multiple of 64 "
             "(FP8 KV scale blocks)");
  DSV4_CHECK(n_heads % o_groups == 0, "num_attention_heads must be divisible by o_groups");
  DSV4_CHECK(static_cast<int>(compress_ratios.size()) == n_layers + n_mtp_layers,
             "compress_ratios has ", compress_ratios.size(), " entries, expected ",
             n_layers + n_mtp_layers, " (num_hidden_layers + num_nextn_predict_layers)");
  bool any_csa = false;
  for (size_t i = 0; i < compress_ratios.size(); ++i) {
    int r = compress_ratios[i];
    DSV4_CHECK(r == 0 || r == 4 || r == 128, "compress_ratios[", i, "] = ", r,
               " is not supported (0, 4 or 128)");
    if (static_cast<int>(i) >= n_layers)
      DSV4_CHECK(r == 0, "the MTP block's compress ratio must be 0");
    any_csa |= (r == 4);
  }
  if (any_csa) {
    DSV4_CHECK(index_n_heads > 0, "index_n_heads must be positive (the model has CSA layers)");
    DSV4_CHECK(index_topk > 0, "index_topk must be positive (the model has CSA layers)");
    DSV4_CHECK(index_head_dim > rope_head_dim && (index_head_dim & (index_head_dim - 1)) == 0,
               "index_head_dim must be a power of two larger than qk_rope_head_dim (Hadamard)");
    DSV4_CHECK(index_head_dim % 32 == 0, "index_head_dim must be a multiple of 32");
  }
  DSV4_CHECK(n_activated_experts <= n_routed_experts,
             "num_experts_per_tok exceeds n_routed_experts");
  DSV4_CHECK(n_hash_layers <= n_layers, "num_hash_layers (", n_hash_layers,
             ") exceeds num_hidden_layers (", n_layers, ")");
  DSV4_CHECK(bos_token_id < vocab_size, "bos_token_id ", bos_token_id, " is not below vocab_size ",
             vocab_size);
  DSV4_CHECK(eos_token_id < vocab_size, "eos_token_id ", eos_token_id, " is not below vocab_size ",
             vocab_size);
}

}  // namespace dsv4
