// Indexer top-k: per token, the min(k, visible) highest BF16 scores in descending order, ties
// to the lower entry index — exactly cpu::topk_desc.
//
// One CTA selects over a segment of <= 16384 entries: a two-pass radix select on the 16-bit
// order-preserving score key finds the k-th largest key T; every entry above T is taken, and
// of the entries equal to T the first ones in index order (a block scan); the k winners are
// then bitonic-sorted on (key, -position), which is unique. Rows longer than one segment are
// cut into segments whose candidates, left unsorted in index order, a second CTA per row
// selects from and sorts in the same way (candidates in segment order, so equal scores stay in
// index order).
//
// Small batches (the decode step: a few tokens over up to 256K entries) run the cluster path
// instead: one launch, a cluster of kTopkCluster CTAs per token, each holding one contiguous
// chunk of the row. The radix select runs over the whole row at once: each CTA builds its
// chunk's histograms, every CTA sums the cluster's through distributed shared memory and finds
// the same threshold; the CTAs before it in the row tell each one (from their histograms) how
// many entries above and at the threshold precede its chunk, so it writes its winners straight
// into their final index-order slots in CTA 0's shared memory, which sorts the k winners. No
// candidates round trip through global memory and no second launch.
#include <cuda_bf16.h>

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/common/sm90/smem.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
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
  int sel[2];  // find_crossing's result: bin, count above it
};

// Larger BF16 score -> larger key; -0 and +0 map to the same key (they compare equal).
__device__ __forceinline__ uint32_t order_key(uint16_t b) {
  if (b == 0x8000u) b = 0;
  return (b & 0x8000u) ? (~uint32_t(b) & 0xffffu) : (uint32_t(b) | 0x8000u);
}

// Exclusive block-wide prefix sum (all kTopkThreads threads call it; `scan`: 32 words).
__device__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* scan) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  if (lane == 31) scan[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const uint32_t x = lane < kWarps ? scan[lane] : 0u;
    uint32_t xi = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t t = __shfl_up_sync(0xffffffffu, xi, o);
      if (lane >= o) xi += t;
    }
    if (lane < kWarps) scan[lane] = xi - x;
  }
  __syncthreads();
  const uint32_t r = incl - v + scan[warp];
  __syncthreads();  // scan is reused by the next call
  return r;
}

// Histogram (256 bins) of `bin_of(i)` over the entries with `take(i)`, warp-aggregated atomics.
template <typename Take, typename BinOf>
__device__ void histogram(int n, uint32_t* hist, Take take, BinOf bin_of) {
  for (int i = threadIdx.x; i < 256; i += kTopkThreads) hist[i] = 0;
  __syncthreads();
  for (int base = 0; base < n; base += kTopkThreads) {
    const int i = base + threadIdx.x;
    const bool ok = i < n && take(i);
    const unsigned active = __ballot_sync(0xffffffffu, ok);
    if (ok) {
      const uint32_t b = bin_of(i);
      const unsigned peers = __match_any_sync(active, b);
      if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[b], uint32_t(__popc(peers)));
    }
  }
  __syncthreads();
}

// The bin where the count from the top crosses `target`: above(bin) < target <=
// above(bin) + hist[bin]; result in sel[0] (bin) / sel[1] (count above it).
__device__ void find_crossing(const uint32_t* hist, uint32_t target, int* sel) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int top = 255 - 8 * lane;  // this lane's bins: top, top-1, ..., top-7
    uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) mine += hist[top - j];
    uint32_t incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t t = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += t;
    }
    uint32_t above = incl - mine;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t h = hist[top - j];
      if (above < target && above + h >= target) {
        sel[0] = top - j;
        sel[1] = int(above);
      }
      above += h;
    }
  }
  __syncthreads();
}

// Sorts v[0, p2) descending (p2 a power of two <= kSortCap; all kTopkThreads threads call it).
// Bitonic network over elements tid + kTopkThreads * e held in registers: exchanges across
// fewer than 32 positions are warp shuffles (no barrier), wider ones go through v with a
// barrier per step — 10 barrier steps for 512 elements instead of 45.
__device__ void bitonic_desc(uint32_t* v, int p2) {
  constexpr int E = kSortCap / kTopkThreads;
  static_assert(E * kTopkThreads == kSortCap, "elements per thread");
  const int tid = threadIdx.x;
  uint32_t x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int pos = tid + kTopkThreads * e;
    x[e] = pos < p2 ? v[pos] : 0u;
  }
  bool in_regs = true;
  for (int size = 2; size <= p2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      if (stride >= 32) {
        if (in_regs) {
#pragma unroll
          for (int e = 0; e < E; ++e)
            if (tid + kTopkThreads * e < p2) v[tid + kTopkThreads * e] = x[e];
          __syncthreads();
          in_regs = false;
        }
        for (int i = tid; i < p2 / 2; i += kTopkThreads) {
          const int pos = 2 * i - (i & (stride - 1));
          const int partner = pos + stride;
          const bool desc = (pos & size) == 0;
          const uint32_t a = v[pos], b = v[partner];
          if ((a < b) == desc) {
            v[pos] = b;
            v[partner] = a;
          }
        }
        __syncthreads();
      } else {
        if (!in_regs) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const int pos = tid + kTopkThreads * e;
            x[e] = pos < p2 ? v[pos] : 0u;
          }
          in_regs = true;
        }
        // Position pos and pos ^ stride (lane ^ stride of this warp): the lower one keeps the
        // larger value where its `size` block sorts descending, the smaller one otherwise.
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int pos = tid + kTopkThreads * e;
          const uint32_t y = __shfl_xor_sync(0xffffffffu, x[e], stride);
          const bool desc = (pos & size) == 0, lower = (pos & stride) == 0;
          x[e] = lower == desc ? max(x[e], y) : min(x[e], y);
        }
      }
    }
  }
  if (in_regs) {
#pragma unroll
    for (int e = 0; e < E; ++e)
      if (tid + kTopkThreads * e < p2) v[tid + kTopkThreads * e] = x[e];
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
      n, sm.hist, [](int) { return true; }, [&](int i) { return uint32_t(sm.keys[i]) >> 8; });
  find_crossing(sm.hist, uint32_t(kk), sm.sel);
  const uint32_t b1 = uint32_t(sm.sel[0]);
  const int above1 = sm.sel[1];
  __syncthreads();
  histogram(
      n, sm.hist, [&](int i) { return (uint32_t(sm.keys[i]) >> 8) == b1; },
      [&](int i) { return uint32_t(sm.keys[i]) & 0xffu; });
  find_crossing(sm.hist, uint32_t(kk - above1), sm.sel);
  const uint32_t thr = (b1 << 8) | uint32_t(sm.sel[0]);
  const int count_gt = above1 + sm.sel[1];
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
  const uint32_t before = block_exclusive_scan(gt | (eq << 16), sm.scan);
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
  bitonic_desc(sm.sorted, p2);
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
  // Launched programmatically (IndexerParams::pdl): nothing is read before the kernel before
  // is complete.
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
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
  sm90::griddep_wait();  // after topk_segment_kernel, always programmatically
  sm90::griddep_launch_dependents();
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

// ---- cluster path ----------------------------------------------------------------------
constexpr int kChunkCap = int(kIndexerMaxVisible / kTopkCluster);  // entries per CTA

struct ClusterSmem {
  uint32_t hist1[256], hist2[256];  // this chunk's histograms (read by the whole cluster)
  uint32_t sum[256];                // the cluster's histogram of the current pass
  uint32_t code[kSortCap];          // CTA 0: (key << 16) | (0xffff - slot) of the winners
  int32_t idx[kSortCap];            // CTA 0: the winners' entry indices, slot = index order
  uint32_t scan[32];
  int sel[2];
  int before_gt[kTopkCluster], before_eq[kTopkCluster];  // per earlier CTA of the row
  uint16_t keys[kChunkCap];
};

// The cluster's histogram: bin b (thread b) summed over every CTA's `local` array.
__device__ void cluster_histogram(const uint32_t* local, uint32_t* sum) {
  if (threadIdx.x < 256) {
    const uint32_t addr = sm90::smem_u32(local + threadIdx.x);
    uint32_t v = 0;
#pragma unroll
    for (int c = 0; c < kTopkCluster; ++c) v += sm90::ld_cluster_4(sm90::map_to_rank(addr, c));
    sum[threadIdx.x] = v;
  }
  __syncthreads();
}

// grid (kTopkCluster, num_tokens), clusters of kTopkCluster CTAs along x: CTA `rank` of token
// `blockIdx.y` holds entries [rank * chunk, (rank + 1) * chunk) of the row.
__global__ void __launch_bounds__(kTopkThreads) topk_cluster_kernel(const TopkArgs a) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  ClusterSmem& sm = *reinterpret_cast<ClusterSmem*>(smem_raw);
  sm90::griddep_wait();  // as topk_segment_kernel
  sm90::griddep_launch_dependents();
  const int rank = int(sm90::cluster_ctarank());
  const int t = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n_t = visible_of_token(a, t);
  const int kk = min(a.k, n_t);
  int32_t* out = a.out + size_t(t) * a.k;
  if (kk <= 0) {  // the whole cluster leaves (same token): nothing selected
    if (rank == 0)
      for (int r = tid; r < a.k; r += kTopkThreads) out[r] = -1;
    return;
  }
  const int chunk = (n_t + kTopkCluster - 1) / kTopkCluster;
  const int lo = min(n_t, rank * chunk);
  const int n = min(n_t, lo + chunk) - lo;
  const uint16_t* row = a.scores + size_t(t) * a.stride + lo;
  for (int i = tid; i < n; i += kTopkThreads) sm.keys[i] = uint16_t(order_key(row[i]));
  __syncthreads();

  // Pass 1: the high byte. Every CTA finds the same crossing bin from the cluster's sum.
  histogram(
      n, sm.hist1, [](int) { return true; }, [&](int i) { return uint32_t(sm.keys[i]) >> 8; });
  sm90::cluster_sync();  // every chunk's hist1 is complete
  cluster_histogram(sm.hist1, sm.sum);
  find_crossing(sm.sum, uint32_t(kk), sm.sel);
  const uint32_t b1 = uint32_t(sm.sel[0]);
  const int above1 = sm.sel[1];
  // Pass 2: the low byte of the entries in bin b1.
  histogram(
      n, sm.hist2, [&](int i) { return (uint32_t(sm.keys[i]) >> 8) == b1; },
      [&](int i) { return uint32_t(sm.keys[i]) & 0xffu; });
  sm90::cluster_sync();  // every chunk's hist2 is complete
  cluster_histogram(sm.hist2, sm.sum);
  find_crossing(sm.sum, uint32_t(kk - above1), sm.sel);
  const uint32_t b2 = uint32_t(sm.sel[0]);
  const uint32_t thr = (b1 << 8) | b2;
  const int need_eq = kk - (above1 + sm.sel[1]);

  // Entries above / at the threshold in each earlier chunk (warp c reads CTA c's histograms).
  if (warp < rank) {
    const uint32_t h1 = sm90::map_to_rank(sm90::smem_u32(sm.hist1), warp);
    const uint32_t h2 = sm90::map_to_rank(sm90::smem_u32(sm.hist2), warp);
    uint32_t gt = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t bin = uint32_t(8 * lane + j);
      if (bin > b1) gt += sm90::ld_cluster_4(h1 + 4 * bin);
      if (bin > b2) gt += sm90::ld_cluster_4(h2 + 4 * bin);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) gt += __shfl_xor_sync(0xffffffffu, gt, o);
    if (lane == 0) {
      sm.before_gt[warp] = int(gt);
      sm.before_eq[warp] = int(sm90::ld_cluster_4(h2 + 4 * b2));
    }
  }
  __syncthreads();
  int gt_off = 0, eq_off = 0;
  for (int c = 0; c < rank; ++c) {
    gt_off += sm.before_gt[c];
    eq_off += sm.before_eq[c];
  }

  // Compaction in index order into CTA 0's slots: thread j owns positions [j*ch, (j+1)*ch).
  const int ch = (n + kTopkThreads - 1) / kTopkThreads;
  const int i_lo = min(n, tid * ch), i_hi = min(n, i_lo + ch);
  uint32_t gt = 0, eq = 0;
  for (int i = i_lo; i < i_hi; ++i) {
    const uint32_t key = sm.keys[i];
    gt += key > thr;
    eq += key == thr;
  }
  const uint32_t before = block_exclusive_scan(gt | (eq << 16), sm.scan);  // n < 65536
  int gt_before = gt_off + int(before & 0xffffu), eq_before = eq_off + int(before >> 16);
  const uint32_t code0 = sm90::map_to_rank(sm90::smem_u32(sm.code), 0);
  const uint32_t idx0 = sm90::map_to_rank(sm90::smem_u32(sm.idx), 0);
  for (int i = i_lo; i < i_hi; ++i) {
    const uint32_t key = sm.keys[i];
    int slot = -1;
    if (key > thr) {
      slot = gt_before + min(eq_before, need_eq);
      ++gt_before;
    } else if (key == thr) {
      if (eq_before < need_eq) slot = gt_before + eq_before;
      ++eq_before;
    }
    if (slot >= 0) {
      sm90::st_cluster_4(code0 + 4 * uint32_t(slot), (key << 16) | (0xffffu - uint32_t(slot)));
      sm90::st_cluster_4(idx0 + 4 * uint32_t(slot), uint32_t(lo + i));
    }
  }
  sm90::cluster_sync();  // CTA 0 holds the kk winners; the others' histograms are read
  if (rank != 0) return;
  int p2 = 1;
  while (p2 < kk) p2 <<= 1;
  for (int i = kk + tid; i < p2; i += kTopkThreads) sm.code[i] = 0;
  __syncthreads();
  bitonic_desc(sm.code, p2);
  for (int r = tid; r < a.k; r += kTopkThreads)
    out[r] = r < kk ? sm.idx[0xffffu - (sm.code[r] & 0xffffu)] : -1;
}

void launch_cluster(const TopkArgs& a, int num_tokens, bool pdl, cudaStream_t stream) {
  static std::atomic<uint64_t> attr{0};
  once_per_device(attr, [] {
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(topk_cluster_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(sizeof(ClusterSmem))));
  });
  LaunchConfig c{dim3(unsigned(kTopkCluster), unsigned(num_tokens)), dim3(kTopkThreads),
                 sizeof(ClusterSmem), stream, pdl};
  c.cluster = dim3(kTopkCluster, 1, 1);
  launch_kernel(c, topk_cluster_kernel, a);
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
  if (indexer_detail::topk_uses_cluster(p)) {
    DSV4_CHECK(p.batch.num_tokens <= 65535, "indexer_topk: ", p.batch.num_tokens,
               " tokens exceed the cluster path's grid");
    launch_cluster(a, p.batch.num_tokens, p.pdl, stream);
    return;
  }
  launch_kernel(LaunchConfig{dim3(unsigned(p.batch.num_tokens), unsigned(segs)), dim3(kTopkThreads),
                             0, stream, p.pdl},
                topk_segment_kernel, a);
  if (segs > 1)
    launch_kernel(
        LaunchConfig{dim3(unsigned(p.batch.num_tokens)), dim3(kTopkThreads), 0, stream, true},
        topk_merge_kernel, a);
}

}  // namespace dsv4::cuda
