// The unusual geometry of custom_config_test (a CSA layer first, one output group, two heads, a
// 16-token window, top-3 selection, 8 experts top-2, a sigmoid router, no MTP), shared with the
// GPU verify suite that runs it too.
#pragma once

#include "model/model_config.h"
#include "model/tiny_checkpoint.h"

namespace dsv4::test {

inline ModelConfig custom_config() {
  ModelConfig c = tiny_preset("flash");
  c.dim = 128;
  c.n_layers = 5;
  c.n_mtp_layers = 0;
  c.compress_ratios = {4, 0, 128, 4, 128};
  c.n_hash_layers = 1;
  c.n_heads = 2;
  c.o_groups = 1;
  c.o_lora_rank = 128;
  c.window_size = 16;
  c.index_n_heads = 4;
  c.index_topk = 3;
  c.n_routed_experts = 8;
  c.n_activated_experts = 2;
  c.score_func = ScoreFunc::kSigmoid;
  c.route_scale = 1.0f;
  c.vocab_size = 500;
  c.validate();
  return c;
}

}  // namespace dsv4::test
