// Where key `slot` of a query's canonical key list lives (sparse_attention.h explains the
// order): the staged entries of the batch, the window ring, or the compressed store.
#pragma once

#include <cstdint>

#include "ops/cuda/common/paged_cache.h"
#include "ops/cuda/sparse_attention/decode.cuh"
#include "ops/cuda/sparse_attention/sparse_attention_config.h"
#include "ops/cuda/sparse_attention/sparse_attention_internal.h"

namespace dsv4::cuda::sparse_attn_detail {

// The query token's place in the batch.
struct QueryInfo {
  int t;      // batch token
  int s;      // sequence
  int p;      // position
  int pos0;   // position of the sequence's first batch token
  int tok0;   // batch index of that token
  int ncomp;  // compressed slots in the key list
  int nkeys;  // window + ncomp
};

__device__ __forceinline__ QueryInfo query_info(const AttnArgs& a, int t) {
  QueryInfo q;
  q.t = t;
  q.s = detail::seq_of_token(a.cu_seqlens, a.num_seqs, t);
  q.tok0 = __ldg(a.cu_seqlens + q.s);
  q.pos0 = __ldg(a.seq_pos0 + q.s);
  q.p = q.pos0 + (t - q.tok0);
  q.ncomp = a.ratio == 4 ? a.topk : (a.ratio == 128 ? (q.p + 1) / 128 : 0);
  q.nkeys = a.window + q.ncomp;
  return q;
}

// Data (576 B) and scales (8 B) of key `slot`, or false for an invalid slot.
__device__ __forceinline__ bool key_source(const AttnArgs& a, const QueryInfo& q, int slot,
                                           const uint8_t*& data, const uint8_t*& scales) {
  using namespace sparse_attn_cfg;
  if (slot < a.window) {
    const int j = max(0, q.p - a.window + 1) + slot;
    if (j > q.p) return false;
    if (a.staged_data != nullptr && j >= q.pos0) {
      const int64_t e = q.tok0 + (j - q.pos0);
      data = a.staged_data + e * kEntryData;
      scales = a.staged_scales + e * kEntryScales;
    } else {
      const int64_t e = j % a.window;
      data = entry_data(a.win, q.s, e);
      scales = entry_scales(a.win, q.s, e);
    }
    return true;
  }
  const int c = slot - a.window;
  if (c >= q.ncomp) return false;
  int64_t idx = c;
  if (a.ratio == 4) {
    idx = __ldg(a.topk_idx + int64_t(q.t) * a.topk_stride + c);
    if (idx < 0 || idx >= (q.p + 1) / 4) return false;
  }
  data = entry_data(a.comp, q.s, idx);
  scales = entry_scales(a.comp, q.s, idx);
  return true;
}

}  // namespace dsv4::cuda::sparse_attn_detail
