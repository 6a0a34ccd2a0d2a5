// The model's weights as they sit in the checkpoint (views into the mapped files), grouped
// by block. Backends build their own working copies from these.
#pragma once

#include <optional>
#include <vector>

#include "io/checkpoint.h"
#include "model/model_config.h"
#include "model/quant_scheme.h"
#include "ops/common/weight_refs.h"

namespace dsv4 {

struct HcRef {
  const TensorView* fn = nullptr;     // F32 [mix, hc*dim]
  const TensorView* base = nullptr;   // F32 [mix]
  const TensorView* scale = nullptr;  // F32 [3] (pre/post/comb) or [1] (head)
};

struct CompressorRef {
  const TensorView* wkv = nullptr;    // BF16 [coff*d, dim]
  const TensorView* wgate = nullptr;  // BF16 [coff*d, dim]
  const TensorView* ape = nullptr;    // F32 [ratio, coff*d]
  const TensorView* norm = nullptr;   // BF16 [d]
};

struct IndexerRef {
  Fp8Ref wq_b;                               // [index_heads*index_dim, q_lora]
  const TensorView* weights_proj = nullptr;  // BF16 [index_heads, dim]
  CompressorRef compressor;                  // ratio 4, d = index_dim
};

struct AttentionRef {
  Fp8Ref wq_a, wq_b, wkv, wo_a, wo_b;
  const TensorView* q_norm = nullptr;
  const TensorView* kv_norm = nullptr;
  const TensorView* attn_sink = nullptr;  // F32 [n_heads]
  std::optional<CompressorRef> compressor;
  std::optional<IndexerRef> indexer;
};

struct MtpRef {
  Fp8Ref e_proj, h_proj;
  const TensorView* enorm = nullptr;
  const TensorView* hnorm = nullptr;
  const TensorView* norm = nullptr;
  HcRef hc_head;
};

struct BlockRef {
  int index = 0;  // 0..n_layers-1 decoder layers, then MTP blocks
  HcRef hc_attn, hc_ffn;
  const TensorView* attn_norm = nullptr;
  const TensorView* ffn_norm = nullptr;
  AttentionRef attn;
  MoeRef ffn;
  std::optional<MtpRef> mtp;
};

struct WeightsRef {
  const TensorView* embed = nullptr;  // BF16 [vocab, dim]
  const TensorView* head = nullptr;   // BF16 [vocab, dim]
  const TensorView* norm = nullptr;   // BF16 [dim]
  HcRef hc_head;
  std::vector<BlockRef> blocks;  // n_layers decoder blocks, then n_mtp_layers MTP blocks
};

// Checks the checkpoint's inventory against the config (every expected tensor present with
// its dtype and shape, nothing unexpected) and binds the views. Throws one dsv4::Error that
// lists every missing, extra and mis-shaped tensor.
WeightsRef bind_weights(const Checkpoint& ckpt, const ModelConfig& config,
                        const QuantScheme& scheme);

// The tensors bind_weights expects, in its order: name, dtype (the first it accepts) and
// shape. From the config and scheme alone (the memory plan sizes the weights with it).
struct ExpectedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};
std::vector<ExpectedTensor> weight_inventory(const ModelConfig& config, const QuantScheme& scheme);

// "layers.3." or "mtp.0."
std::string block_prefix(const ModelConfig& config, int block);

}  // namespace dsv4
