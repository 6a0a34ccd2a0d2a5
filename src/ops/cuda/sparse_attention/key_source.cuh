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

// ---- the lookup of a key slot, in stages ---------------------------------------------------
// Its loads depend on each other (top-k entry -> page id -> entry bytes), so the kernels run
// the stages for different key blocks in one pass (the wgmma producer: top-k entries four
// blocks ahead, pages three, L2 prefetch two; the mma loader: pages one block ahead of the
// copies, top-k entries two) and never wait on their own lookups.
enum : int { kKeyInvalid = 0, kKeyStaged = 1, kKeyRing = 2, kKeyComp = 3 };
struct KeyLoc {
  int kind = kKeyInvalid;
  int entry = 0;  // staged entry, ring slot or compressed entry
  int page = 0;   // kKeyRing / kKeyComp: the page id (a load in flight until first used)
};
struct KeyAddr {
  const uint8_t* data = nullptr;  // nullptr: invalid slot
  const uint8_t* scales = nullptr;
};

// Stage 1: the top-k row's entry of a CSA slot (a load); 0 for every other slot. It needs only
// the batch token t (a CSA key list always holds `topk` compressed slots), so a kernel can
// start it before its query's sequence and position are known.
__device__ __forceinline__ int key_topk_entry(const AttnArgs& a, int t, int slot) {
  const int c = slot - a.window;
  if (a.ratio != 4 || c < 0 || c >= a.topk) return 0;
  return __ldg(a.topk_idx + int64_t(t) * a.topk_stride + c);
}
__device__ __forceinline__ int key_topk_entry(const AttnArgs& a, const QueryInfo& q, int slot) {
  return key_topk_entry(a, q.t, slot);
}

// Stage 2: the store and entry of `slot` (topk_entry from stage 1) and its page id (a load).
// Invalid: window positions before 0, slots past the key list, CSA entries -1 or outside
// [0, (p+1)/4).
__device__ __forceinline__ KeyLoc key_locate(const AttnArgs& a, const QueryInfo& q, int slot,
                                             int topk_entry) {
  KeyLoc l;
  if (slot < a.window) {
    const int j = max(0, q.p - a.window + 1) + slot;
    if (j > q.p) return l;
    if (a.staged_data != nullptr && j >= q.pos0) {
      l.kind = kKeyStaged;
      l.entry = q.tok0 + (j - q.pos0);
      return l;
    }
    l.kind = kKeyRing;
    l.entry = j % a.window;
    l.page = __ldg(a.win.block_table + int64_t(q.s) * a.win.stride + l.entry / a.win.page_size);
    return l;
  }
  const int c = slot - a.window;
  if (c >= q.ncomp) return l;
  int idx = c;
  if (a.ratio == 4) {
    idx = topk_entry;
    if (idx < 0 || idx >= (q.p + 1) / 4) return l;
  }
  l.kind = kKeyComp;
  l.entry = idx;
  l.page = __ldg(a.comp.block_table + int64_t(q.s) * a.comp.stride + idx / a.comp.page_size);
  return l;
}

// Stage 3: the addresses (no load); entry_data / entry_scales with the page already known.
__device__ __forceinline__ KeyAddr key_address(const AttnArgs& a, const KeyLoc& l) {
  using namespace sparse_attn_cfg;
  KeyAddr r;
  if (l.kind == kKeyStaged) {
    r.data = a.staged_data + int64_t(l.entry) * kEntryData;
    r.scales = a.staged_scales + int64_t(l.entry) * kEntryScales;
  } else if (l.kind != kKeyInvalid) {
    const PagedStoreView& v = l.kind == kKeyRing ? a.win : a.comp;
    const uint8_t* base = v.pages + int64_t(l.page) * v.page_bytes;
    const int e = l.entry % v.page_size;
    r.data = base + int64_t(e) * kEntryData;
    r.scales = base + int64_t(v.page_size) * kEntryData + int64_t(e) * kEntryScales;
  }
  return r;
}

// The predecoded BF16 row of `slot` (kWgmmaPredecoded; sparse_attention_predecode.cu lays the
// rows out), -1 for an invalid slot: the same slots as key_locate, without the page lookup.
__device__ __forceinline__ int64_t key_row(const AttnArgs& a, const QueryInfo& q, int slot,
                                           int topk_entry) {
  if (slot < a.window) {
    const int j = max(0, q.p - a.window + 1) + slot;
    if (j > q.p) return -1;
    if (a.staged_data != nullptr && j >= q.pos0) return q.tok0 + (j - q.pos0);
    return a.num_tokens + int64_t(q.s) * a.window + j % a.window;
  }
  const int c = slot - a.window;
  if (c >= q.ncomp) return -1;
  int idx = c;
  if (a.ratio == 4) {
    idx = topk_entry;
    if (idx < 0 || idx >= (q.p + 1) / 4) return -1;
  }
  return a.num_tokens + int64_t(a.num_seqs) * a.window + int64_t(q.s) * a.comp_rows + idx;
}

}  // namespace dsv4::cuda::sparse_attn_detail
