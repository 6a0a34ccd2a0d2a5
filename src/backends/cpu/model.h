// The DeepSeek-V4 forward pass on the CPU backend: embedding, hc-stream blocks (attention with
// window + compressed KV, sink and grouped output; MoE), the hc head and logits, and the MTP
// block. Every cache store is read and written through HostCache in the shared byte layout.
//
// Per-token arithmetic does not depend on how tokens are batched or chunked: each output row
// is computed from its own input row in a fixed order, and attention keys are always listed
// in the same canonical order (the window's 128 slots oldest first, padded, then compressed
// entries), so one prefill, token-by-token decode and any chunking give identical bits.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backends/cpu/host_cache.h"
#include "backends/cpu/rank_context.h"
#include "backends/cpu/weights.h"
#include "kvcache/block_manager.h"
#include "model/model_config.h"
#include "model/op_event.h"
#include "model/step.h"
#include "model/trace.h"
#include "model/trace_observer.h"

namespace dsv4 {

class CpuModel {
 public:
  CpuModel(const ModelConfig& config, cpu::ModelWeights weights);

  const ModelConfig& config() const { return cfg_; }
  const cpu::ModelWeights& weights() const { return w_; }
  // The parallel engine: this model is one rank's shard (its weights prepared with the rank's
  // cpu::WeightShard) and runs the collectives of `rank` (which outlives the model). Null:
  // one rank.
  void set_rank(const RankContext* rank) { rank_ = rank; }

  // embed[tokens] repeated over the hc streams: [n, hc, dim].
  void embed(const int32_t* tokens, int n, float* streams) const;
  // One block over all chunks' tokens (rows in chunk order); streams [rows, hc, dim] in place.
  // Writes the block's window, compressed KV, indexer keys and compressor states.
  void run_block(int block, const std::vector<ChunkRef>& chunks, float* streams, HostCache& cache,
                 TraceSink* trace = nullptr) const;
  // The attention sub-layer alone: x = attn_norm output [rows, dim] -> out [rows, dim]
  // (after wo_b), with all of its cache reads and writes.
  void run_attention(int block, const std::vector<ChunkRef>& chunks, const float* x, float* out,
                     HostCache& cache, TraceSink* trace = nullptr) const;
  // The MoE sub-layer alone: x = ffn_norm output [rows, dim] -> out [rows, dim].
  void run_moe(int block, const int32_t* tokens, int rows, const float* x, float* out,
               int32_t* route_experts = nullptr, float* route_weights = nullptr) const;
  // hc_head + norm + head: [n, hc, dim] -> fp32 logits [n, vocab].
  void logits(const float* streams, int n, float* out) const;

  // Decoder: embed, every layer, and logits of the requested rows. `rows` lists row indices
  // (into the concatenated chunks) whose logits are wanted; logits are [rows.size(), vocab].
  // If `hidden_out` is given it receives the last layer's streams [total rows, hc, dim].
  // If `first_nonfinite` is given it receives per token row the first block whose output
  // streams hold a non-finite value, or -1 when every block's output is finite (a cheap scan
  // after each block).
  std::vector<float> forward(const std::vector<ChunkRef>& chunks, HostCache& cache,
                             const std::vector<int>& rows, TraceSink* trace = nullptr,
                             std::vector<float>* hidden_out = nullptr,
                             std::vector<int>* first_nonfinite = nullptr) const;

  // MTP block `j`: from the decoder's last streams at positions start.. and the next tokens,
  // logits [n_rows, vocab] predicting two ahead. Chunks carry the MTP positions and tokens.
  // `streams_out`, when given, receives the block's output streams [n_rows, hc, dim] (before
  // its hc_head): the hidden input of a chained draft.
  std::vector<float> mtp_forward(int j, const std::vector<ChunkRef>& chunks,
                                 const float* main_streams, HostCache& cache,
                                 TraceSink* trace = nullptr,
                                 std::vector<float>* streams_out = nullptr) const;

 private:
  // Traces are op observers (model/op_event.h): the public calls wrap a TraceSink in a
  // TraceObserver (null: none) and the forward pass reports its sub-layers and routing to it.
  std::unique_ptr<TraceObserver> tracer(TraceSink* trace) const;
  void block(int block, const std::vector<ChunkRef>& chunks, float* streams, HostCache& cache,
             OpObserver* obs) const;
  void attention_chunks(int block, const std::vector<ChunkRef>& chunks, const float* x, float* out,
                        HostCache& cache, OpObserver* obs) const;
  void attention(const cpu::BlockWeights& bw, const ChunkRef& ch, int chunk_index, const float* x,
                 float* out, HostCache& cache, OpObserver* obs) const;
  void head_logits(const cpu::HcWeights& hc, const std::vector<float>& norm, const float* streams,
                   int n, float* out) const;
  // Every tensor-parallel rank's [rows, width] slab, as [rows, ranks x width] in rank order.
  std::vector<float> gather_heads(const std::vector<float>& mine, int rows, int width) const;

  ModelConfig cfg_;
  cpu::ModelWeights w_;
  const RankContext* rank_ = nullptr;
};

}  // namespace dsv4
