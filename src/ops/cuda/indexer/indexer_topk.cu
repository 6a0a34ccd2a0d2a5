// Indexer top-k: per token, the min(k, visible) highest BF16 scores in descending order, ties
// to the lower entry index — exactly cpu::topk_desc.
//
// One CTA selects over a segment of <= 16384 entries: a two-pass radix select on the 16-bit
// order-preserving score key finds the k-th largest key T; every entry above T is taken, and
// of the entries equal to T the first ones in index order (a block scan); the k winners are
// then bitonic-sorted on (key, -position), which is unique. Rows longer than one segment are
// cut into segments (16384 entries, or about sqrt(visible x k) at small batch so that a row
// spreads over several CTAs) whose candidates, left unsorted in index order, a second CTA per
// row selects from and sorts in the same way (candidates in segment order, so equal scores
// stay in index order).
#include <cuda_bf16.h>

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/indexer/indexer.h"
#include "ops/cuda/indexer/indexer_config.h"
#include "ops/cuda/indexer/indexer_internal.h"
#include "ops/cuda/sparse_attention/decode.cuh"

namespace dsv4::cuda {
namespace {

using namespace indexer_cfg;
constexpr int kWarps = kTopkThreads / 32;

struct TopkSmem {
  uint16_t keys[kSegment];
  uint32_t sorted[kSortCap];
  uint32_t hist[256];
  uint32_t scan[32];
  int sel_bin, sel_above;
};

// Larger BF16 score -> larger key; -0 and +0 map to the same key (they compare equal).
__device__ __forceinline__ uint32_t order_key(uint16_t b) {
  if (b == 0x8000u) b = 0;
  return (b & 0x8000u) ? (~uint32_t(b) & 0xffffu) : (uint32_t(b) | 0x8000u);
}

// Exclusive block-wide prefix sum (all kTopkThreads threads call it).
__device__ uint32_t block_exclusive_scan(uint32_t v, TopkSmem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  if (lane == 31) sm.scan[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const uint32_t x = lane < kWarps ? sm.scan[lane] : 0u;
    uint32_t xi = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t t = __shfl_up_sync(0xffffffffu, xi, o);
      if (lane >= o) xi += t;
    }
    if (lane < kWarps) sm.scan[lane] = xi - x;
  }
  __syncthreads();
  const uint32_t r = incl - v + sm.scan[warp];
  __syncthreads();  // sm.scan is reused by the next call
  return r;
}

// Histogram of `bin_of(i)` over the entries with `take(i)`, warp-aggregated atomics.
template <typename Take, typename BinOf>
__device__ void histogram(int n, TopkSmem& sm, Take take, BinOf bin_of) {
  for (int i = threadIdx.x; i < 256; i += kTopkThreads) sm.hist[i] = 0;
  __syncthreads();
  for (int base = 0; base < n; base += kTopkThreads) {
    const int i = base + threadIdx.x;
    const bool ok = i < n && take(i);
    const unsigned active = __ballot_sync(0xffffffffu, ok);
    if (ok) {
      const uint32_t b = bin_of(i);
      const unsigned peers = __match_any_sync(active, b);
      if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&sm.hist[b], uint32_t(__popc(peers)));
    }
  }
  __syncthreads();
}

// The bin where the count from the top crosses `target`: above(bin) < target <=
// above(bin) + hist[bin]; result in sm.sel_bin / sm.sel_above.
__device__ void find_crossing(TopkSmem& sm, uint32_t target) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int top = 255 - 8 * lane;  // this lane's bins: top, top-1, ..., top-7
    uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) mine += sm.hist[top - j];
    uint32_t incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t t = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += t;
    }
    uint32_t above = incl - mine;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t h = sm.hist[top - j];
      if (above < target && above + h >= target) {
        sm.sel_bin = top - j;
        sm.sel_above = int(above);
      }
      above += h;
    }
  }
  __syncthreads();
}

// Selects the min(k, n) largest of sm.keys[0, n) (ties to the lower position) and leaves them
// in sm.sorted[0, k') as (key << 16) | (0xffff - position), descending when `sort`, else in
// position order. Returns k'.
__device__ int select_sorted(int n, int k, TopkSmem& sm, bool sort = true) {
  const int kk = min(k, n);
  if (kk <= 0) return 0;
  histogram(
      n, sm, [](int) { return true; }, [&](int i) { return uint32_t(sm.keys[i]) >> 8; });
  find_crossing(sm, uint32_t(kk));
  const uint32_t b1 = uint32_t(sm.sel_bin);
  const int above1 = sm.sel_above;
  __syncthreads();
  histogram(
      n, sm, [&](int i) { return (uint32_t(sm.keys[i]) >> 8) == b1; },
      [&](int i) { return uint32_t(sm.keys[i]) & 0xffu; });
  find_crossing(sm, uint32_t(kk - above1));
  const uint32_t thr = (b1 << 8) | uint32_t(sm.sel_bin);
  const int count_gt = above1 + sm.sel_above;
  const int need_eq = kk - count_gt;

  // Compaction in index order: thread j owns positions [j*ch, (j+1)*ch).
  const int ch = (n + kTopkThreads - 1) / kTopkThreads;
  const int lo = min(n, int(threadIdx.x) * ch), hi = min(n, lo + ch);
  uint32_t gt = 0, eq = 0;
  for (int i = lo; i < hi; ++i) {
    const uint32_t key = sm.keys[i];
    gt += key > thr;
    eq += key == thr;
  }
  const uint32_t before = block_exclusive_scan(gt | (eq << 16), sm);
  int gt_before = int(before & 0xffffu), eq_before = int(before >> 16);
  for (int i = lo; i < hi; ++i) {
    const uint32_t key = sm.keys[i];
    const uint32_t code = (key << 16) | (0xffffu - uint32_t(i));
    if (key > thr) {
      sm.sorted[gt_before + min(eq_before, need_eq)] = code;
      ++gt_before;
    } else if (key == thr) {
      if (eq_before < need_eq) sm.sorted[gt_before + eq_before] = code;
      ++eq_before;
    }
  }
  if (!sort) {
    __syncthreads();
    return kk;
  }
  int p2 = 1;
  while (p2 < kk) p2 <<= 1;
  for (int i = kk + threadIdx.x; i < p2; i += kTopkThreads) sm.sorted[i] = 0;
  __syncthreads();
  // Bitonic sort, descending.
  for (int size = 2; size <= p2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < p2 / 2; i += kTopkThreads) {
        const int pos = 2 * i - (i & (stride - 1));
        const int partner = pos + stride;
        const bool desc = (pos & size) == 0;
        const uint32_t x = sm.sorted[pos], y = sm.sorted[partner];
        if ((x < y) == desc) {
          sm.sorted[pos] = y;
          sm.sorted[partner] = x;
        }
      }
      __syncthreads();
    }
  }
  return kk;
}

struct TopkArgs {
  const uint16_t* scores;
  int64_t stride;
  const int32_t* cu_seqlens;
  const int32_t* seq_pos0;
  int num_seqs;
  int ratio;
  int k;
  int seg_len;  // entries per segment (<= kSegment)
  int max_segments;
  int32_t* out;
  uint2* cand;  // [num_tokens, max_segments, k] (ordered key, entry index)
};

__device__ __forceinline__ int visible_of_token(const TopkArgs& a, int t) {
  const int s = detail::seq_of_token(a.cu_seqlens, a.num_seqs, t);
  const int pos = __ldg(a.seq_pos0 + s) + (t - __ldg(a.cu_seqlens + s));
  return (pos + 1) / a.ratio;
}

// grid (num_tokens, max_segments): segment `blockIdx.y` of token `blockIdx.x`.
__global__ void __launch_bounds__(kTopkThreads) topk_segment_kernel(const TopkArgs a) {
  __shared__ TopkSmem sm;
  const int t = blockIdx.x, sg = blockIdx.y;
  const int n_t = visible_of_token(a, t);
  const int seg_lo = sg * a.seg_len;
  int32_t* out = a.out + size_t(t) * a.k;
  if (n_t == 0) {
    if (sg == 0)
      for (int r = threadIdx.x; r < a.k; r += kTopkThreads) out[r] = -1;
    return;
  }
  if (seg_lo >= n_t) return;
  const int n = min(a.seg_len, n_t - seg_lo);
  const uint16_t* row = a.scores + size_t(t) * a.stride + seg_lo;
  for (int i = threadIdx.x; i < n; i += kTopkThreads) sm.keys[i] = uint16_t(order_key(row[i]));
  __syncthreads();
  const bool whole_row = n_t <= a.seg_len;
  const int kk = select_sorted(n, a.k, sm, whole_row);
  if (whole_row) {
    for (int r = threadIdx.x; r < a.k; r += kTopkThreads)
      out[r] = r < kk ? int32_t(0xffffu - (sm.sorted[r] & 0xffffu)) : -1;
  } else {
    uint2* cand = a.cand + (size_t(t) * a.max_segments + sg) * a.k;
    for (int r = threadIdx.x; r < kk; r += kTopkThreads) {
      const uint32_t v = sm.sorted[r];
      cand[r] = make_uint2(v >> 16, uint32_t(seg_lo) + (0xffffu - (v & 0xffffu)));
    }
  }
}

// grid (num_tokens): rows longer than one segment select among their segments' candidates.
__global__ void __launch_bounds__(kTopkThreads) topk_merge_kernel(const TopkArgs a) {
  __shared__ TopkSmem sm;
  const int t = blockIdx.x;
  const int n_t = visible_of_token(a, t);
  if (n_t <= a.seg_len) return;
  const int segs = (n_t + a.seg_len - 1) / a.seg_len;
  const int last = n_t - (segs - 1) * a.seg_len;
  // Every segment but the last holds seg_len >= k entries, so k candidates: positions are
  // contiguous at stride k.
  const int n = (segs - 1) * a.k + min(a.k, last);
  const uint2* cand = a.cand + size_t(t) * a.max_segments * a.k;
  for (int i = threadIdx.x; i < n; i += kTopkThreads) sm.keys[i] = uint16_t(cand[i].x);
  __syncthreads();
  const int kk = select_sorted(n, a.k, sm);
  int32_t* out = a.out + size_t(t) * a.k;
  for (int r = threadIdx.x; r < a.k; r += kTopkThreads)
    out[r] = r < kk ? int32_t(cand[0xffffu - (sm.sorted[r] & 0xffffu)].y) : -1;
}

}  // namespace

void indexer_topk(const IndexerParams& p, cudaStream_t stream) {
  indexer_detail::validate(p, indexer_detail::Stage::kTopk);
  if (p.batch.num_tokens == 0) return;
  static_assert(int64_t(kIndexerMaxVisible / kSegment) * kIndexerMaxTopk <= kSegment,
                "merged candidates must fit one segment");
  const int segs = std::max(1, indexer_detail::num_segments(p));
  const int seg_len = indexer_detail::topk_segment_len(p);
  DSV4_CHECK(seg_len >= p.topk && seg_len <= kSegment && int64_t(segs) * p.topk <= kSegment,
             "indexer_topk: segments of ", seg_len, " entries x ", segs, " for k ", p.topk);
  TopkArgs a{reinterpret_cast<const uint16_t*>(p.scores),
             p.score_stride,
             p.batch.cu_seqlens,
             p.batch.seq_pos0,
             p.batch.num_seqs,
             p.ratio,
             p.topk,
             seg_len,
             segs,
             p.topk_idx,
             static_cast<uint2*>(p.workspace)};
  topk_segment_kernel<<<dim3(unsigned(p.batch.num_tokens), unsigned(segs)), kTopkThreads, 0,
                        stream>>>(a);
  DSV4_CUDA_CHECK(cudaGetLastError());
  if (segs > 1) {
    topk_merge_kernel<<<unsigned(p.batch.num_tokens), kTopkThreads, 0, stream>>>(a);
    DSV4_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace dsv4::cuda
