// Kernel arguments and launchers shared by the sparse-attention translation units.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/common/paged_cache.h"
#include "ops/cuda/sparse_attention/sparse_attention.h"

namespace dsv4::cuda::sparse_attn_detail {

// Floats per (token, head, split) partial in the workspace: O[512], m, l, pad.
constexpr int kPartialFloats = 516;

struct AttnArgs {
  const __nv_bfloat16* q;
  __nv_bfloat16* out;
  const float* sink;
  float scale_log2;  // softmax_scale * log2(e): scores in the exp2 domain
  const int32_t* cu_seqlens;
  const int32_t* seq_pos0;
  int num_seqs;
  int num_tokens;
  int n_heads;
  int head_tiles;
  int window;
  PagedStoreView win;
  const uint8_t* staged_data;
  const uint8_t* staged_scales;
  int ratio;
  PagedStoreView comp;
  const int32_t* topk_idx;
  int topk;
  int64_t topk_stride;
  int num_splits;
  int blocks_per_split;
  float* partials;  // [num_tokens * n_heads, num_splits, kPartialFloats] when num_splits > 1
  bool pdl;         // launch the attention kernel programmatically (SparseAttnParams::pdl)
  // SparseAttnKernel::kWgmmaPredecoded: the keys decoded to BF16 (sparse_attention_predecode.cu
  // lays the rows out; key_row() in key_source.cuh finds them), and the compressed-entry rows
  // each sequence has there.
  __nv_bfloat16* keys_bf16;
  int comp_rows;
};

void launch_mma(const AttnArgs& a, int heads_per_cta, cudaStream_t stream);
// The wgmma kernel's producer: kStaged copies raw entries into a shared-memory ring ahead of
// its decode (the default); kDirect loads them into registers (the previous kernel,
// SparseAttnKernel::kWgmmaDirect); kPredecoded copies the BF16 rows launch_predecode wrote.
enum class WgProducer { kDirect, kStaged, kPredecoded };
// pairs: CTA pairs where the head tiles pair up (n_heads % 128 == 0; not with kPredecoded).
void launch_wgmma(const AttnArgs& a, WgProducer producer, bool pairs, cudaStream_t stream);
bool wgmma_available();  // built with the CuTe sm_90a headers
void launch_combine(const AttnArgs& a, cudaStream_t stream);
// The predecoded key rows (kWgmmaPredecoded): their count — the batch's tokens, then each
// sequence's window slots and compressed entries (the layout key_row() reads) — and the kernel
// that writes them (before the attention kernel, which it lets launch programmatically).
inline int64_t predecode_rows(int num_tokens, int num_seqs, int window, int comp_rows) {
  return int64_t(num_tokens) + int64_t(num_seqs) * (window + comp_rows);
}
void launch_predecode(const AttnArgs& a, cudaStream_t stream);

}  // namespace dsv4::cuda::sparse_attn_detail
