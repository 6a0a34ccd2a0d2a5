// The attention front end on the GPU (CpuModel::attention's q and window-KV steps):
//  - rope_cos_sin: the per-token RoPE table of one layer kind (plain / YaRN inv_freq);
//  - q_norm_rope: per-head weightless RMS in BF16 arithmetic (cpu::rms_norm_bf16_weightless)
//    then RoPE of the last 64 dims (cpu::rope_apply);
//  - kv_norm_rope_insert: kv_norm (cpu::rms_norm) -> RoPE -> FP8 entry (cpu::encode_kv_entry)
//    -> the paged window ring at slot pos % window, in one kernel; also the staged entries and
//    the decoded (fake-quantised) keys when asked for;
//  - kv_quant_insert: the same without norm/RoPE (input = final BF16 kv values), byte-exact;
//  - kv_insert_staged: copies staged entries into the ring (the CPU inserts the chunk's entries
//    after attention, because a chunk longer than one token overwrites ring slots that its
//    earlier queries still read: token p+1 replaces p-127, which query p attends to). Inserting
//    straight into the ring before attention is exact only for one token per sequence; with
//    more (prefill chunks, s_q >= 2 speculative decode) write `staged` (+ `decoded` for the
//    chunk's own keys), run attention, then kv_insert_staged.
// Activations are BF16 on the device (the CPU holds the same values in floats).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/common/paged_cache.h"

namespace dsv4::cuda {

constexpr int kHeadDim = 512;  // DeepSeek-V4 head_dim (q, kv, compressed kv)
constexpr int kRopeDim = 64;   // RoPE dims: the last 64 of a head
constexpr int kNopeDim = 448;
constexpr int kRopePairs = kRopeDim / 2;

// cos_sin[t * 32 + i] = {cos, sin}(float(positions[t]) * inv_freq[i]): the fp32 angle of
// cpu::RopeTable::cos_sin, cos/sin evaluated in double and rounded to float (the CPU does the
// same with glibc; see ops/cuda/common/numerics.cuh for the only possible difference).
struct RopeTableParams {
  const int32_t* positions = nullptr;  // [num_tokens], 0 <= pos < 2^31
  const float* inv_freq = nullptr;     // [32] device copy of cpu::RopeTable::inv_freq
  int num_tokens = 0;
  float2* cos_sin = nullptr;  // [num_tokens, 32] out
};
void rope_cos_sin(const RopeTableParams& p, cudaStream_t stream = nullptr);

// q [T, H, 512] BF16 (wq_b output) -> per-head RMS (BF16 arithmetic) -> RoPE on dims 448..511.
struct QNormRopeParams {
  const __nv_bfloat16* q = nullptr;  // [num_tokens, num_heads, 512]
  __nv_bfloat16* out = nullptr;      // same shape; may equal q (in place)
  const float2* cos_sin = nullptr;   // [num_tokens, 32] from rope_cos_sin
  int num_tokens = 0;
  int num_heads = 0;
  float eps = 1e-6f;
  // Programmatic dependent launch: start while the kernel before finishes (q is read after
  // griddepcontrol.wait); graph-capturable.
  bool pdl = false;
};
void q_norm_rope(const QNormRopeParams& p, cudaStream_t stream = nullptr);

// Window KV of a batch of tokens. Token t belongs to block-table row token_seq[t] (< 0: a
// padding token, never inserted) at absolute position positions[t]; its ring slot is
// positions[t] % window. Outputs that are null are skipped; at least one must be given.
// Ring inserts of one call must hit distinct slots: a sequence may insert at most `window`
// consecutive tokens per call (the ring keeps only the last `window` anyway; mark earlier ones
// token_seq = -1), otherwise two tokens race for one slot.
struct KvInsertParams {
  const __nv_bfloat16* kv = nullptr;           // [num_tokens, 512]
  const __nv_bfloat16* norm_weight = nullptr;  // [512] kv_norm (kv_norm_rope_insert only)
  const float2* cos_sin = nullptr;             // [num_tokens, 32] (kv_norm_rope_insert only)
  float eps = 1e-6f;
  int num_tokens = 0;
  const int32_t* token_seq = nullptr;  // [num_tokens] (needed when cache.pages is set)
  const int32_t* positions = nullptr;  // [num_tokens] (needed when cache.pages is set)
  int window = 128;                    // ring slots per sequence
  PagedStoreView cache{};              // window ring (584-byte entries) or pages null
  uint8_t* staged = nullptr;           // [num_tokens, 584]: 576 data bytes then 8 scale bytes
  __nv_bfloat16* decoded = nullptr;    // [num_tokens, 512]: the entry as attention reads it
  bool pdl = false;                    // programmatic dependent launch (as QNormRopeParams::pdl)
};
// kv_norm -> RoPE -> FP8 entry -> ring (the CPU's rms_norm + rope_apply + encode_kv_entry).
void kv_norm_rope_insert(const KvInsertParams& p, cudaStream_t stream = nullptr);
// Entry of kv as given (already normalised and rotated) -> ring: bytes identical to
// cpu::encode_kv_entry on the same BF16 values.
void kv_quant_insert(const KvInsertParams& p, cudaStream_t stream = nullptr);

// q_norm_rope(q) and kv_norm_rope_insert(kv) in one launch (the decode path: both read what the
// GEMMs before them wrote, so one programmatic launch replaces two): the same bytes as the two
// calls. Both take the same tokens and the same pdl setting.
void q_norm_rope_kv_insert(const QNormRopeParams& q, const KvInsertParams& kv,
                           cudaStream_t stream = nullptr);

// staged [num_tokens, 584] -> ring slots (token_seq < 0: skipped).
struct KvInsertStagedParams {
  const uint8_t* staged = nullptr;
  int num_tokens = 0;
  const int32_t* token_seq = nullptr;
  const int32_t* positions = nullptr;
  int window = 128;
  PagedStoreView cache{};
};
void kv_insert_staged(const KvInsertStagedParams& p, cudaStream_t stream = nullptr);

}  // namespace dsv4::cuda
