// The CPU backend's working copy of the weights: every quantised tensor dequantised exactly
// to float once at load, GEMM weights transposed for the CPU linear kernel.
#pragma once

#include <optional>
#include <vector>

#include "model/model_config.h"
#include "model/op_event.h"
#include "model/parallel_layout.h"
#include "model/weights.h"
#include "ops/cpu/compressor.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/mhc.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/rope.h"

namespace dsv4::cpu {

struct HcWeights {
  std::vector<float> fn, base, scale;
};

struct IndexerWeights {
  Linear wq_b;          // FP8 [heads*dim, q_lora]
  Linear weights_proj;  // BF16 [heads, dim]
  CompressorWeights compressor;
};

struct AttentionWeights {
  Linear wq_a, wq_b, wkv, wo_b;  // FP8
  std::vector<Linear> wo_a;      // per output group: BF16 [o_lora, heads_per_group*head_dim]
  std::vector<float> q_norm, kv_norm, sink;
  std::optional<CompressorWeights> compressor;
  std::optional<IndexerWeights> indexer;
  RopeTable rope;  // the layer's table: plain for SWA-only, YaRN for compressed layers
};

struct MtpWeights {
  Linear e_proj, h_proj;  // FP8
  std::vector<float> enorm, hnorm, norm;
  HcWeights hc_head;
};

struct BlockWeights {
  int index = 0;
  int ratio = 0;
  HcWeights hc_attn, hc_ffn;
  std::vector<float> attn_norm, ffn_norm;
  AttentionWeights attn;
  MoeWeights ffn;
  std::optional<MtpWeights> mtp;
};

struct ModelWeights {
  std::vector<float> embed;  // [vocab, dim] BF16 values
  Linear head;               // kF32 [vocab, dim]
  std::vector<float> norm;
  HcWeights hc_head;
  std::vector<BlockWeights> blocks;
};

// The mHC parameters of one unit (hc_pre/hc_post pair or head) for the CPU ops.
HcParams hc_params(const ModelConfig& c, const HcWeights& w);

// The block's linear / RMSNorm weight an op event names (model/op_event.h).
const Linear& block_linear(const BlockWeights& b, LinearId id);
const std::vector<float>& block_norm(const BlockWeights& b, NormId id);

// What one rank of the parallel engine keeps: contiguous shares of the attention heads (wq_b
// rows, sinks), output groups (wo_a), indexer heads (its wq_b and weights_proj rows) and routed
// experts (the others stay empty, indices global). The default keeps everything.
struct WeightShard {
  int heads_lo = 0, heads = -1;  // -1: all
  int groups_lo = 0, groups = -1;
  int index_heads_lo = 0, index_heads = -1;
  int experts_lo = 0, experts = -1;
};
// Rank `w`'s shard under a parallel layout (both backends' parallel runners).
WeightShard shard_of(const ParallelLayout& layout, int w);

// Dequantises and validates values (NaN scales, expert ids in range); only the shard's share
// of what is split (an expert outside it is not even read).
ModelWeights prepare_weights(const ModelConfig& config, const WeightsRef& ref,
                             const WeightShard& shard = {});

// Bytes the weights' values take (what the memory plan's CPU weight figure counts; RoPE
// tables aside).
int64_t weight_bytes(const ModelWeights& w);

}  // namespace dsv4::cpu
