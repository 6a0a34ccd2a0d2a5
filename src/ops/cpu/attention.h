// Sparse attention over an explicit key list with a per-head sink, as the reference kernel
// computes it: fp32 scores, online softmax over blocks of 64 keys, probabilities rounded to
// BF16 against the running max before the P.V product, the sink only in the denominator,
// value = key (the same 512-dim vector, RoPE tail included), BF16 out.
#pragma once

namespace dsv4::cpu {

constexpr int kAttnKeyBlock = 64;

struct SparseAttnParams {
  int n_heads = 0;
  int head_dim = 0;
  float softmax_scale = 0;
  const float* sink = nullptr;  // [n_heads]
  // BF16 probabilities before P.V, as the reference kernel; false keeps them fp32 (used to
  // measure how sensitive an output is to that rounding).
  bool bf16_probs = true;
};

// q: [n_heads, head_dim] BF16 values. keys[j]: head_dim values, or nullptr for an invalid
// (-1) slot. out: [n_heads, head_dim].
void sparse_attention(const SparseAttnParams& p, const float* q, const float* const* keys,
                      int num_keys, float* out);

}  // namespace dsv4::cpu
