// Indexer top-k: per token, the min(k, visible) highest BF16 scores in descending order, ties
// to the lower entry index — exactly cpu::topk_desc.
//
// One launch. Each token's row is spread over C CTAs (a cluster of C = 1, 2, 4 or 8, chosen by
// batch so the grid fills the GPU): CTA `rank` holds one contiguous chunk of the row in
// registers, KPT consecutive entries a thread as 16-bit order-preserving keys (vector loads).
// A two-pass radix select on the keys (high byte, then the low byte of the entries in the
// crossing bin) finds the k-th largest key T: each CTA builds its chunk's histograms and, in a
// cluster, every CTA sums the cluster's through distributed shared memory and finds the same
// threshold. Every entry above T is taken, and of the entries equal to T the first ones in
// index order: the CTAs before it in the row tell each CTA (from their histograms) how many
// entries above and at T precede its chunk, a block scan does the same within the chunk, so
// every winner goes straight to its index-order slot in CTA 0's shared memory. CTA 0 sorts the
// k winners on (key, -slot), which is unique. Keys never leave registers; no candidates round
// trip through global memory.
#include <cuda_bf16.h>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
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
constexpr int kHistCopies = 8;
static_assert(kHistCopies % 4 == 0 && 32 % kHistCopies == 0, "histogram copies");

// Shared memory of one CTA (CTA 0 of a row also collects the winners).
struct RowSmem {
  uint32_t hist1[256], hist2[256];  // this chunk's histograms (read by the whole cluster)
  uint32_t sum[256];                // the cluster's histogram of the current pass (C > 1)
  alignas(16) uint32_t part[256 * kHistCopies];  // histogram()'s copies
  uint32_t code[kSortCap];  // CTA 0: (key << 16) | (0xffff - slot) of the winners
  int32_t idx[kSortCap];    // CTA 0: the winners' entry indices, slot = index order
  uint32_t scan[32];
  int sel[2];                                                  // find_crossing's bin, count above
  int before_gt[kTopkMaxCluster], before_eq[kTopkMaxCluster];  // per earlier CTA of the row
};

// Larger BF16 score -> larger key; -0 and +0 map to the same key (they compare equal).
__device__ __forceinline__ uint32_t order_key(uint16_t b) {
  if (b == 0x8000u) b = 0;
  return (b & 0x8000u) ? (~uint32_t(b) & 0xffffu) : (uint32_t(b) | 0x8000u);
}

// Key e of a thread's keys, held two a word (e even: the low half).
template <int W>
__device__ __forceinline__ uint32_t key_at(const uint32_t (&kv)[W], int e) {
  return (kv[e / 2] >> (16 * (e & 1))) & 0xffffu;
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

// Histogram (256 bins) of bin_of(key) over this thread's `nvalid` keys with take(key) (keys
// packed two a word in kv; `per` <= KPT: keys a thread in this CTA) into `hist`. Lanes count
// into kHistCopies interleaved copies (`part`, [bin][copy]) with fire-and-forget shared
// atomics, so a warp's lanes on one hot bin (BF16 scores fill few high-byte bins) collide at
// most 32 / kHistCopies ways and no lane waits on a warp-wide match; the copies are summed
// after. H200, 2026-12-04 (indexer_bench --topk, back to back): one CTA over 32K entries 35.5
// µs with warp-aggregated atomics (match.any), 25.0 with 8 copies, 25.4 with a copy a lane.
template <int KPT, typename Take, typename BinOf>
__device__ void histogram(const uint32_t (&kv)[KPT / 2], int per, int nvalid, uint32_t* part,
                          uint32_t* hist, Take take, BinOf bin_of) {
  for (int i = threadIdx.x; i < 256 * kHistCopies; i += kTopkThreads) part[i] = 0;
  __syncthreads();
  const uint32_t copy = threadIdx.x & (kHistCopies - 1);
#pragma unroll
  for (int e = 0; e < KPT; ++e) {
    if (e >= per) break;  // uniform
    const uint32_t key = key_at(kv, e);
    if (e < nvalid && take(key)) atomicAdd(&part[bin_of(key) * kHistCopies + copy], 1u);
  }
  __syncthreads();
  if (threadIdx.x < 256) {
    const uint4* c = reinterpret_cast<const uint4*>(part + threadIdx.x * kHistCopies);
    uint32_t v = 0;
#pragma unroll
    for (int q = 0; q < kHistCopies / 4; ++q) {
      const uint4 x = c[q];
      v += x.x + x.y + x.z + x.w;
    }
    hist[threadIdx.x] = v;
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

// Sorts v[0, P2) descending (all kTopkThreads threads call it). Bitonic network over elements
// tid + kTopkThreads * e held in registers, unrolled for the size so that every step's partner
// and direction are constants: exchanges across fewer than 32 positions are warp shuffles (no
// barrier), wider ones go through v with a barrier per step (10 of the 45 steps for 512
// elements). Positions past P2 only ever meet each other (partners differ in bits < P2).
template <int P2>
__device__ void bitonic_desc(uint32_t* v) {
  constexpr int E = P2 > kTopkThreads ? P2 / kTopkThreads : 1;
  static_assert(P2 >= 2 && (P2 & (P2 - 1)) == 0 && P2 <= kSortCap, "sort width");
  const int tid = threadIdx.x;
  uint32_t x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int pos = tid + kTopkThreads * e;
    x[e] = pos < P2 ? v[pos] : 0u;
  }
#pragma unroll
  for (int size = 2; size <= P2; size <<= 1) {
    if (size > 32) {  // strides size / 2 .. 32 through shared memory
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (tid + kTopkThreads * e < P2) v[tid + kTopkThreads * e] = x[e];
      __syncthreads();
#pragma unroll
      for (int stride = size >> 1; stride >= 32; stride >>= 1) {
        if (tid < P2 / 2) {  // P2 / 2 <= kTopkThreads pairs: one a thread
          const int pos = 2 * tid - (tid & (stride - 1));
          const uint32_t a = v[pos], b = v[pos + stride];
          const bool desc = (pos & size) == 0;
          v[pos] = desc ? max(a, b) : min(a, b);
          v[pos + stride] = desc ? min(a, b) : max(a, b);
        }
        __syncthreads();
      }
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int pos = tid + kTopkThreads * e;
        x[e] = pos < P2 ? v[pos] : 0u;
      }
    }
    // Position pos and pos ^ stride (lane ^ stride of this warp): the lower one keeps the
    // larger value where its `size` block sorts descending, the smaller one otherwise.
#pragma unroll
    for (int stride = (size > 32 ? 16 : size >> 1); stride > 0; stride >>= 1) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int pos = tid + kTopkThreads * e;
        const uint32_t y = __shfl_xor_sync(0xffffffffu, x[e], stride);
        const bool keep_max = ((pos & size) == 0) == ((pos & stride) == 0);
        x[e] = keep_max ? max(x[e], y) : min(x[e], y);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (tid + kTopkThreads * e < P2) v[tid + kTopkThreads * e] = x[e];
  __syncthreads();
}

// bitonic_desc for a run-time width p2 (a power of two, 1..kSortCap): the widths from P2 up.
template <int P2 = 2>
__device__ void sort_desc(uint32_t* v, int p2) {
  if (p2 < 2) {
    __syncthreads();  // one element (or none), already in place
  } else if (p2 == P2) {
    bitonic_desc<P2>(v);
  } else if constexpr (P2 < kSortCap) {
    sort_desc<2 * P2>(v, p2);
  }
}

struct TopkArgs {
  const uint16_t* scores;
  int64_t stride;
  const int32_t* cu_seqlens;
  const int32_t* seq_pos0;
  int num_seqs;
  int ratio;
  int k;
  // The host's plan, from the batch's longest row: entries a CTA (chunk) and a thread (per),
  // multiples of 8, so that every thread's score loads are known before its row's length.
  int chunk;
  int per;
  bool vec_loads;          // rows 16-byte aligned (stride a multiple of 8, scores 16-byte aligned)
  bool one_token_per_seq;  // one token a sequence (max_seq_tokens 1, as many sequences as
                           // tokens): token t is sequence t
  int32_t* out;
};

// Visible entries of token t. Decode batches (one token a sequence) read one position; others
// find t's sequence with the whole block in one round trip (every thread tests a sequence)
// instead of a binary search of dependent loads. All threads call it (`s_seq`: shared).
__device__ int visible_of_token(const TopkArgs& a, int t, int* s_seq) {
  if (a.one_token_per_seq) return (__ldg(a.seq_pos0 + t) + 1) / a.ratio;
  for (int i = threadIdx.x; i < a.num_seqs; i += kTopkThreads)
    if (__ldg(a.cu_seqlens + i) <= t && t < __ldg(a.cu_seqlens + i + 1)) *s_seq = i;
  __syncthreads();
  const int s = *s_seq;
  return (__ldg(a.seq_pos0 + s) + (t - __ldg(a.cu_seqlens + s)) + 1) / a.ratio;
}

// The cluster's histogram: bin b (thread b) summed over every CTA's `local` array.
template <int C>
__device__ void cluster_histogram(const uint32_t* local, uint32_t* sum) {
  if (threadIdx.x < 256) {
    const uint32_t addr = sm90::smem_u32(local + threadIdx.x);
    uint32_t v = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) v += sm90::ld_cluster_4(sm90::map_to_rank(addr, c));
    sum[threadIdx.x] = v;
  }
  __syncthreads();
}

// grid (C, num_tokens), clusters of C CTAs along x (C = 1: no cluster): CTA `rank` of token
// `blockIdx.y` holds entries [rank * chunk, (rank + 1) * chunk) of the row, chunk a multiple of
// 8; thread j entries [j * per, (j + 1) * per) of the chunk, per a multiple of 8 and at most KPT
// (the host's plan sizes KPT for the longest row).
template <int C, int KPT>
__global__ void __launch_bounds__(kTopkThreads) indexer_topk_kernel(const TopkArgs a) {
  static_assert(KPT % 8 == 0 && C >= 1 && C <= kTopkMaxCluster, "topk tile");
  __shared__ RowSmem sm;
  // Launched programmatically (IndexerParams::pdl): nothing is read before the kernel before
  // is complete.
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int rank = C > 1 ? int(sm90::cluster_ctarank()) : 0;
  const int t = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = a.per;  // uniform, <= KPT
  const int lo = rank * a.chunk, base = tid * per;

  // This thread's scores, loaded before its row's length is known (the plan fixes where each
  // thread reads): entries [lo + base, + per) within the row's storage (score_stride); those
  // past the row's visible entries are never counted (nvalid below).
  uint32_t kv[KPT / 2];
  const uint16_t* src = a.scores + size_t(t) * a.stride + lo + base;
  const int64_t room = a.stride - (lo + base);  // entries of the row's storage from here
  const int avail = room <= 0 ? 0 : (room < per ? int(room) : per);
#pragma unroll
  for (int w = 0; w < KPT / 2; ++w) kv[w] = 0;
  if (a.vec_loads && avail == per) {
#pragma unroll
    for (int v = 0; v < KPT / 8; ++v) {
      if (8 * v >= per) break;
      const uint4 w = __ldg(reinterpret_cast<const uint4*>(src) + v);
      kv[4 * v + 0] = w.x;
      kv[4 * v + 1] = w.y;
      kv[4 * v + 2] = w.z;
      kv[4 * v + 3] = w.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < KPT; e += 2) {
      if (e >= per) break;
      const uint32_t x0 = e < avail ? __ldg(src + e) : 0u;
      const uint32_t x1 = e + 1 < avail ? __ldg(src + e + 1) : 0u;
      kv[e / 2] = x0 | (x1 << 16);
    }
  }

  const int n_t = visible_of_token(a, t, &sm.sel[0]);
  const int kk = min(a.k, n_t);
  int32_t* out = a.out + size_t(t) * a.k;
  if (kk <= 0) {  // the whole cluster leaves (same token): nothing selected
    if (rank == 0)
      for (int r = tid; r < a.k; r += kTopkThreads) out[r] = -1;
    return;
  }
  const int n = max(0, min(n_t - lo, a.chunk));  // this CTA's entries of the row
  const int nvalid = max(0, min(per, n - base));
#pragma unroll
  for (int w = 0; w < KPT / 2; ++w)
    if (2 * w < per)
      kv[w] = order_key(uint16_t(kv[w] & 0xffffu)) | (order_key(uint16_t(kv[w] >> 16)) << 16);

  // Pass 1: the high byte. Every CTA finds the same crossing bin from the cluster's sum.
  histogram<KPT>(
      kv, per, nvalid, sm.part, sm.hist1, [](uint32_t) { return true; },
      [](uint32_t key) { return key >> 8; });
  const uint32_t* h = sm.hist1;
  if constexpr (C > 1) {
    sm90::cluster_sync();  // every chunk's hist1 is complete
    cluster_histogram<C>(sm.hist1, sm.sum);
    h = sm.sum;
  }
  find_crossing(h, uint32_t(kk), sm.sel);
  const uint32_t b1 = uint32_t(sm.sel[0]);
  const int above1 = sm.sel[1];
  // Pass 2: the low byte of the entries in bin b1.
  histogram<KPT>(
      kv, per, nvalid, sm.part, sm.hist2, [b1](uint32_t key) { return (key >> 8) == b1; },
      [](uint32_t key) { return key & 0xffu; });
  h = sm.hist2;
  if constexpr (C > 1) {
    sm90::cluster_sync();  // every chunk's hist2 is complete
    cluster_histogram<C>(sm.hist2, sm.sum);
    h = sm.sum;
  }
  find_crossing(h, uint32_t(kk - above1), sm.sel);
  const uint32_t b2 = uint32_t(sm.sel[0]);
  const uint32_t thr = (b1 << 8) | b2;
  const int need_eq = kk - (above1 + sm.sel[1]);

  // Entries above / at the threshold in each earlier chunk (warp c reads CTA c's histograms).
  int gt_off = 0, eq_off = 0;
  if constexpr (C > 1) {
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
    for (int c = 0; c < rank; ++c) {
      gt_off += sm.before_gt[c];
      eq_off += sm.before_eq[c];
    }
  }

  // Compaction in index order into CTA 0's slots.
  uint32_t gt = 0, eq = 0;
#pragma unroll
  for (int e = 0; e < KPT; ++e) {
    if (e >= per) break;
    const uint32_t key = key_at(kv, e);
    gt += e < nvalid && key > thr;
    eq += e < nvalid && key == thr;
  }
  const uint32_t before = block_exclusive_scan(gt | (eq << 16), sm.scan);  // n <= 32768
  int gt_before = gt_off + int(before & 0xffffu), eq_before = eq_off + int(before >> 16);
  const uint32_t code0 = C > 1 ? sm90::map_to_rank(sm90::smem_u32(sm.code), 0) : 0u;
  const uint32_t idx0 = C > 1 ? sm90::map_to_rank(sm90::smem_u32(sm.idx), 0) : 0u;
  if (gt | eq) {
#pragma unroll
    for (int e = 0; e < KPT; ++e) {
      if (e >= per) break;
      const uint32_t key = key_at(kv, e);
      int slot = -1;
      if (e < nvalid) {
        if (key > thr) {
          slot = gt_before + min(eq_before, need_eq);
          ++gt_before;
        } else if (key == thr) {
          if (eq_before < need_eq) slot = gt_before + eq_before;
          ++eq_before;
        }
      }
      if (slot >= 0) {
        const uint32_t code = (key << 16) | (0xffffu - uint32_t(slot));
        const int32_t entry = lo + base + e;
        if constexpr (C > 1) {
          sm90::st_cluster_4(code0 + 4 * uint32_t(slot), code);
          sm90::st_cluster_4(idx0 + 4 * uint32_t(slot), uint32_t(entry));
        } else {
          sm.code[slot] = code;
          sm.idx[slot] = entry;
        }
      }
    }
  }
  if constexpr (C > 1) {
    sm90::cluster_sync();  // CTA 0 holds the kk winners; the others' histograms are read
    if (rank != 0) return;
  }
  int p2 = 1;
  while (p2 < kk) p2 <<= 1;
  for (int i = kk + tid; i < p2; i += kTopkThreads) sm.code[i] = 0;
  __syncthreads();
  sort_desc(sm.code, p2);
  for (int r = tid; r < a.k; r += kTopkThreads)
    out[r] = r < kk ? sm.idx[0xffffu - (sm.code[r] & 0xffffu)] : -1;
}

template <int C, int KPT>
void launch_topk(const TopkArgs& a, int num_tokens, bool pdl, cudaStream_t stream) {
  LaunchConfig c{dim3(unsigned(C), unsigned(num_tokens)), dim3(kTopkThreads), 0, stream, pdl};
  c.cluster = dim3(C, 1, 1);
  launch_kernel(c, indexer_topk_kernel<C, KPT>, a);
}

template <int C>
void launch_topk_kpt(const TopkArgs& a, int kpt, int num_tokens, bool pdl, cudaStream_t stream) {
  switch (kpt) {
    case 8:
      return launch_topk<C, 8>(a, num_tokens, pdl, stream);
    case 16:
      return launch_topk<C, 16>(a, num_tokens, pdl, stream);
    case 32:
      return launch_topk<C, 32>(a, num_tokens, pdl, stream);
    case 64:
      return launch_topk<C, 64>(a, num_tokens, pdl, stream);
  }
  throw Error(cat("indexer_topk: no kernel for ", kpt, " keys a thread"));
}

}  // namespace

void indexer_topk(const IndexerParams& p, cudaStream_t stream) {
  indexer_detail::validate(p, indexer_detail::Stage::kTopk);
  if (p.batch.num_tokens == 0) return;
  const indexer_detail::TopkPlan plan = indexer_detail::topk_plan(p);
  DSV4_CHECK(p.batch.num_tokens <= 65535, "indexer_topk: ", p.batch.num_tokens,
             " tokens exceed the grid");
  const bool vec = p.score_stride % 8 == 0 && reinterpret_cast<uintptr_t>(p.scores) % 16 == 0;
  const TopkArgs a{reinterpret_cast<const uint16_t*>(p.scores),
                   p.score_stride,
                   p.batch.cu_seqlens,
                   p.batch.seq_pos0,
                   p.batch.num_seqs,
                   p.ratio,
                   p.topk,
                   plan.chunk,
                   plan.per,
                   vec,
                   p.batch.max_seq_tokens == 1 && p.batch.num_seqs == p.batch.num_tokens,
                   p.topk_idx};
  const int T = p.batch.num_tokens;
  switch (plan.ctas_per_row) {
    case 1:
      return launch_topk_kpt<1>(a, plan.keys_per_thread, T, p.pdl, stream);
    case 2:
      return launch_topk_kpt<2>(a, plan.keys_per_thread, T, p.pdl, stream);
    case 4:
      return launch_topk_kpt<4>(a, plan.keys_per_thread, T, p.pdl, stream);
    case 8:
      return launch_topk_kpt<8>(a, plan.keys_per_thread, T, p.pdl, stream);
  }
  throw Error(cat("indexer_topk: no kernel for ", plan.ctas_per_row, " CTAs a row"));
}

}  // namespace dsv4::cuda
