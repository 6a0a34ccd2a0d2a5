// One forward step's batch description on the device: which sequence and position every token
// row has, the sequences' block tables for the three page kinds (window, C4, C128), their
// compressor-state slots and the rows whose logits are wanted. Built on the host from the
// step's chunks (one contiguous run of tokens per sequence, as CpuModel takes them) and
// uploaded with one asynchronous copy into a metadata buffer of fixed layout, so a captured
// CUDA graph can replay a step whose metadata changed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "backends/cpu/model.h"
#include "kvcache/block_manager.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/sparse_attention/attn_batch.h"

namespace dsv4 {

// Capacities the metadata buffer is laid out for.
struct StepLimits {
  int max_tokens = 0;                     // token rows per step
  int max_seqs = 0;                       // sequences per step
  int stride[kNumPageKinds] = {1, 1, 1};  // block-table row length per page kind
};

struct DeviceStep {
  // Host-side sizes (they size the launches).
  int num_seqs = 0;
  int num_tokens = 0;
  int max_seq_tokens = 0;
  int64_t max_position = 0;  // an upper bound of every token's position (>= the true maximum)
  bool decode_only = false;  // every sequence brings exactly one token
  int num_logit_rows = 0;

  // Device arrays (int32).
  const int32_t* tokens = nullptr;      // [T] token ids
  const int32_t* positions = nullptr;   // [T] absolute positions
  const int32_t* token_seq = nullptr;   // [T] batch row (block-table row) of each token
  const int32_t* insert_seq = nullptr;  // [T] token_seq, or -1 for a token whose window slot a
                                        // later token of the same chunk overwrites
  const int32_t* cu_seqlens = nullptr;  // [S + 1]
  const int32_t* seq_pos0 = nullptr;    // [S]
  const int32_t* state_slot = nullptr;  // [S]
  const int32_t* logit_rows = nullptr;  // [R] token rows whose logits are wanted
  const int32_t* tables[kNumPageKinds] = {nullptr, nullptr, nullptr};  // [S, stride]
  int stride[kNumPageKinds] = {1, 1, 1};

  // Host copies (checks, traces).
  std::vector<ChunkRef> chunks;
  std::vector<int> logit_row_list;

  cuda::AttnBatch attn_batch() const {
    cuda::AttnBatch b;
    b.cu_seqlens = cu_seqlens;
    b.seq_pos0 = seq_pos0;
    b.num_seqs = num_seqs;
    b.num_tokens = num_tokens;
    b.max_seq_tokens = max_seq_tokens;
    b.max_position = max_position;
    return b;
  }
  const int32_t* table(PageKind k) const { return tables[int(k)]; }
  int table_stride(PageKind k) const { return stride[int(k)]; }
};

class StepBuffers {
 public:
  StepBuffers(const StepLimits& limits, int window);
  ~StepBuffers();
  StepBuffers(const StepBuffers&) = delete;
  StepBuffers& operator=(const StepBuffers&) = delete;

  const StepLimits& limits() const { return limits_; }

  // Fills the metadata of `chunks` (rows in chunk order) and `logit_rows`, and enqueues its
  // upload on `stream`. `max_position` < 0: the true maximum; else an upper bound to size
  // launches with (CUDA graphs replay one bound for many steps). The host staging buffer is
  // reused: the previous step's upload must have completed (the runner synchronises per step).
  // Throws dsv4::Error when the step exceeds the capacities.
  DeviceStep build(const std::vector<ChunkRef>& chunks, const std::vector<int>& logit_rows,
                   int64_t max_position, cudaStream_t stream);

 private:
  // Offsets (int32 elements) of each array in the metadata buffer.
  struct Layout {
    int64_t tokens, positions, token_seq, insert_seq, cu_seqlens, seq_pos0, state_slot, logit_rows,
        tables[kNumPageKinds], total;
  };

  StepLimits limits_;
  int window_ = 0;
  Layout layout_{};
  int32_t* host_ = nullptr;  // pinned
  cuda::DeviceBuffer<int32_t> device_;
};

// The end of the context bucket of a decode step, for CUDA graphs' launch bounds: the next power
// of two >= 1024 of its largest position + 1, capped by the planned context (the graphs of the
// CUDA runner and of the parallel one).
int64_t decode_bucket(const std::vector<ChunkRef>& chunks, int64_t max_context);

}  // namespace dsv4
