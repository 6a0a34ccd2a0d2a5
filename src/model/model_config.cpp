#include "model/model_config.h"

#include "core/error.h"

namespace dsv4 {

void ModelConfig::validate() const {
  auto positive = [](int v, const char* name) { DSV4_CHECK(v > 0, name, " must be positive"); };
  positive(vocab_size, "vocab_size");
  positive(dim, "hidden_size");
  positive(n_layers, "num_hidden_layers");
  DSV4_CHECK(n_mtp_layers >= 0, "num_nextn_predict_layers must be >= 0");
  positive(n_heads, "num_attention_heads");
  positive(head_dim, "head_dim");
  positive(q_lora_rank, "q_lora_rank");
  positive(o_groups, "o_groups");
  positive(o_lora_rank, "o_lora_rank");
  positive(window_size, "sliding_window");
  positive(hc_mult, "hc_mult");
  positive(hc_sinkhorn_iters, "hc_sinkhorn_iters");
  positive(n_routed_experts, "n_routed_experts");
  positive(n_activated_experts, "num_experts_per_tok");
  positive(moe_inter_dim, "moe_intermediate_size");
  // FP8 activation quantisation works on whole 128-wide blocks of every GEMM input.
  DSV4_CHECK(dim % 128 == 0, "hidden_size ", dim, " must be a multiple of 128");
  DSV4_CHECK(q_lora_rank % 128 == 0, "q_lora_rank must be a multiple of 128");
  DSV4_CHECK(moe_inter_dim % 128 == 0, "moe_intermediate_size must be a multiple of 128");
  DSV4_CHECK((o_groups * o_lora_rank) % 128 == 0, "o_groups*o_lora_rank must be a multiple of 128");
  DSV4_CHECK(rope_head_dim > 0 && rope_head_dim % 2 == 0 && rope_head_dim < head_dim,
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
    positive(index_n_heads, "index_n_heads");
    positive(index_topk, "index_topk");
    DSV4_CHECK(index_head_dim > rope_head_dim && (index_head_dim & (index_head_dim - 1)) == 0,
               "index_head_dim must be a power of two larger than qk_rope_head_dim (Hadamard)");
    DSV4_CHECK(index_head_dim % 32 == 0, "index_head_dim must be a multiple of 32");
  }
  DSV4_CHECK(rope_theta > 0 && compress_rope_theta > 0, "rope thetas must be positive");
  DSV4_CHECK(original_seq_len >= 0, "original_max_position_embeddings must be >= 0");
  DSV4_CHECK(n_activated_experts <= n_routed_experts,
             "num_experts_per_tok exceeds n_routed_experts");
  DSV4_CHECK(n_shared_experts == 1, "n_shared_experts must be 1 (as in the reference)");
  DSV4_CHECK(n_hash_layers >= 0 && n_hash_layers <= n_layers, "num_hash_layers out of range");
  DSV4_CHECK(swiglu_limit >= 0, "swiglu_limit must be >= 0");
  DSV4_CHECK(bos_token_id >= 0 && bos_token_id < vocab_size, "bos_token_id out of range");
  DSV4_CHECK(eos_token_id >= 0 && eos_token_id < vocab_size, "eos_token_id out of range");
  DSV4_CHECK(max_position_embeddings > 0, "max_position_embeddings must be positive");
}

}  // namespace dsv4
