// The sampling kernels (sampling.h). Every fp32 operation that decides a choice is the
// reference's, written with explicit round-to-nearest intrinsics so that nvcc cannot contract
// or reorder it: the patches (add, divide or multiply, subtract) and s = (z - zmax) / T.
//
// Selections work on order keys: the fp32 bits mapped so that unsigned order is float order
// (-0 mapped to +0: the reference compares floats, where they tie). The weight the reference
// ranks by, e = exp(double(s)), is a non-decreasing function of z, so the k-th largest e is the
// e of the k-th largest z, and the top-p threshold (the e of the last token the reference's
// sorted cumulative sum needs) is the e of the largest key sigma whose "mass at or above sigma"
// reaches top_p times the kept mass: if W(sigma) >= top_p * mass and W(next key) < top_p *
// mass, every e larger than e(sigma) belongs to a key above sigma, so its sorted prefix sum
// falls short, and the prefix up to the ties of e(sigma) reaches the target. Ties in e of
// distinct keys are handled because membership is always decided on e itself.
//
// Where a choice can differ from the CPU's (none in exact arithmetic):
//  - exp() and log() in fp64: CUDA's and glibc's are within one ulp (2^-52 relative) of the
//    exact value, so an e or a race value can differ by one ulp. A choice flips only if two
//    candidates' race values, or an e and the min_p / top-k threshold, are within 2^-52 of each
//    other relative: of order 1e-16 per comparison on continuous logits.
//  - the top-p sums: here the kept mass and W(sigma) are exact fixed-point sums (2^-96 units,
//    truncation below 2^-96 per term: deterministic, independent of thread order); the CPU
//    sums sequentially in fp64, within (n - 1) * 2^-53 of exact relative (n kept tokens: at
//    most 129,280, so 1.4e-11). The cutoff token can differ only if a sorted prefix sum falls
//    within that margin of top_p * mass, a probability of order 1e-11 per draw.
//  - the log-sum-exp of the logprobs (fp64, per-thread sums, a tree per block, then the blocks
//    of the row's cluster in rank order): see the test for the bound, which holds for any
//    order; it does not affect any choice. Its last bits can depend on the number of blocks per
//    row (the batch size and the SM count), never on scheduling.
//
// Splitting a row over a cluster's blocks changes no choice: the first non-finite index, the
// maximum and the argmax (larger key, then lower index) and the race (larger value, then lower
// index) are order-free combines; the histograms are exact integer or fixed-point sums, and every
// block chooses each digit from the same summed histogram; the top alternatives are sorted by
// (key, index) after they are gathered.
#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/sampling/sampling.h"
#include "ops/cuda/sampling/sampling_config.h"

namespace dsv4::cuda {
namespace {

using namespace sampling_cfg;
namespace cg = cooperative_groups;
using u128 = unsigned __int128;
using u64 = unsigned long long;

__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = __float_as_uint(x);
  if (u == 0x80000000u) u = 0;  // -0 ties with +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ bool non_finite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// The reference's s = (z - zmax) / T, and its weight e = exp(double(s)).
__device__ __forceinline__ float scaled(float z, float zmax, float t) {
  return __fdiv_rn(__fsub_rn(z, zmax), t);
}
__device__ __forceinline__ double weight(float z, float zmax, float t) {
  return exp(double(scaled(z, zmax, t)));
}

// A bound below which s cannot reach e >= thr (> 0), so most tokens skip the fp64 exp: exp is
// within one ulp (2^-52 relative) of exact, the margin 1e-6 (1 + |log thr|) is far above that
// and above the fp32 rounding of the bound. thr = 0 keeps every token.
__device__ __forceinline__ float scaled_floor(double thr) {
  if (!(thr > 0)) return -INFINITY;
  const double l = log(thr);
  return float(l - 1e-6 * (1 + fabs(l)));
}

// e in [0, 1] in units of 2^-96, truncated.
__device__ __forceinline__ u128 to_fixed(double e) {
  if (!(e > 0)) return 0;
  int ex;
  const double m = frexp(e, &ex);  // e = m * 2^ex, m in [0.5, 1), ex <= 1
  const u64 mant = u64(ldexp(m, 53));
  const int s = ex + 43;  // e * 2^96 = mant * 2^(ex - 53 + 96)
  if (s >= 0) return u128(mant) << s;
  return -s >= 64 ? u128(0) : u128(mant >> -s);
}

__device__ __forceinline__ double fixed_to_double(u128 v) {
  return double(u64(v >> 64)) * 0x1p-32 + double(u64(v)) * 0x1p-96;
}

// A 128-bit fixed-point add into (hi, lo) shared words: exact, so the sum does not depend on
// the order the threads arrive in.
__device__ __forceinline__ void atomic_add_fixed(u64* hi, u64* lo, u128 v) {
  const u64 vl = u64(v), vh = u64(v >> 64);
  const u64 old = atomicAdd(lo, vl);
  const u64 up = vh + (old + vl < old ? 1 : 0);
  if (up) atomicAdd(hi, up);
}

// Histogram updates from a whole warp at once (every lane calls; bucket < 0: nothing to add):
// the lanes adding to one bucket are combined first, so that a row whose keys share a few
// leading digits (the usual case: logits span a few binades) does not serialise on one
// shared-memory counter. Integer sums: the result does not depend on the order.
__device__ __forceinline__ void warp_count(unsigned* count, int bucket) {
  const unsigned peers = __match_any_sync(0xffffffffu, bucket);
  if (bucket >= 0 && int(threadIdx.x & 31) == __ffs(peers) - 1)
    atomicAdd(&count[bucket], unsigned(__popc(peers)));
}

__device__ __forceinline__ void warp_weigh(u64* hi, u64* lo, int bucket, u128 v) {
  const unsigned active = __ballot_sync(0xffffffffu, bucket >= 0);
  if (!active) return;
  const unsigned peers = __match_any_sync(0xffffffffu, bucket);
  u128 sum = 0;
  for (unsigned m = active; m; m &= m - 1) {
    const int j = __ffs(m) - 1;
    const u64 l = __shfl_sync(0xffffffffu, u64(v), j),
              h = __shfl_sync(0xffffffffu, u64(v >> 64), j);
    if ((peers >> j) & 1) sum += (u128(h) << 64) | u128(l);
  }
  if (bucket >= 0 && int(threadIdx.x & 31) == __ffs(peers) - 1)
    atomic_add_fixed(hi + bucket, lo + bucket, sum);
}

// Streams a row: every thread calls f(i, x, valid) the same number of times (so f may use warp
// collectives), and each i in [0, n) comes exactly once with valid set, x = z[i]. The body is
// read as float4 with kUnroll loads in flight per thread (one block must keep ~32 KB in flight
// to stream from L2 or HBM at speed; one scalar load per thread kept 2 KB); a head of up to
// three scalars aligns it, a tail of up to three follows. The order a thread sees indices in
// depends on the geometry, so every caller combines with an order-free rule (min, max with
// index tie-break, integer or exact fixed-point sums) or, for the fp64 sum of the log-sum-exp,
// one whose error bound does not depend on the order.
template <typename F>
__device__ __forceinline__ void for_each_logit_uniform(const float* __restrict__ z, int n,
                                                       const F& f) {
  const int tid = int(threadIdx.x), threads = int(blockDim.x);
  const int head = min(n, int(((16 - (reinterpret_cast<uintptr_t>(z) & 15)) & 15) >> 2));
  f(tid, tid < head ? __ldg(z + tid) : 0.0f, tid < head);
  const int nv = (n - head) >> 2;
  const float4* v = reinterpret_cast<const float4*>(z + head);
  for (int base = 0; base < nv; base += threads * kUnroll) {
    float4 q[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * threads + tid;
      q[u] = j < nv ? __ldg(v + j) : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * threads + tid;
      const bool ok = j < nv;
      const int i = head + 4 * j;
      f(i, q[u].x, ok);
      f(i + 1, q[u].y, ok);
      f(i + 2, q[u].z, ok);
      f(i + 3, q[u].w, ok);
    }
  }
  const int tail = head + 4 * nv;
  const bool in_tail = tail + tid < n;
  f(tail + tid, in_tail ? __ldg(z + tail + tid) : 0.0f, in_tail);
}

// The same, calling f(i, x) only for valid elements (no warp collectives in f).
template <typename F>
__device__ __forceinline__ void for_each_logit(const float* __restrict__ z, int n, const F& f) {
  for_each_logit_uniform(z, n, [&](int i, float x, bool ok) {
    if (ok) f(i, x);
  });
}

struct KeyIndex {
  uint32_t key;
  int index;
};
struct LargerKeyFirstIndex {
  __device__ KeyIndex operator()(const KeyIndex& a, const KeyIndex& b) const {
    if (a.key != b.key) return a.key > b.key ? a : b;
    return a.index < b.index ? a : b;
  }
};
struct MinInt {
  __device__ int operator()(int a, int b) const { return a < b ? a : b; }
};
struct MaxFloat {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct RaceValue {
  double v;
  int index;
};
struct LargerValueFirstIndex {
  __device__ RaceValue operator()(const RaceValue& a, const RaceValue& b) const {
    if (a.v != b.v) return a.v > b.v ? a : b;
    return a.index < b.index ? a : b;
  }
};

using ReduceKey = cub::BlockReduce<KeyIndex, kThreads>;
using ReduceRace = cub::BlockReduce<RaceValue, kThreads>;
using ReduceInt = cub::BlockReduce<int, kThreads>;
using ReduceFloat = cub::BlockReduce<float, kThreads>;
using ReduceDouble = cub::BlockReduce<double, kThreads>;
using ScanInt = cub::BlockScan<int, kThreads>;

union TempStorage {
  typename ReduceKey::TempStorage key;
  typename ReduceRace::TempStorage race;
  typename ReduceInt::TempStorage i;
  typename ReduceFloat::TempStorage f;
  typename ReduceDouble::TempStorage d;
  typename ScanInt::TempStorage scan;
};

struct SearchStorage {
  unsigned count[kBuckets];  // this block's histogram
  u64 hi[kBuckets], lo[kBuckets];
  unsigned count_all[kBuckets];  // the cluster's, summed in rank order
  u64 hi_all[kBuckets], lo_all[kBuckets];
  uint32_t prefix;
  unsigned remaining;
  u64 above_hi, above_lo;
  double target;
};

__device__ __forceinline__ unsigned shfl_down(unsigned v, int d) {
  return __shfl_down_sync(0xffffffffu, v, d);
}
__device__ __forceinline__ u128 shfl_down(u128 v, int d) {
  const u64 lo = __shfl_down_sync(0xffffffffu, u64(v), d),
            hi = __shfl_down_sync(0xffffffffu, u64(v >> 64), d);
  return (u128(hi) << 64) | u128(lo);
}
__device__ __forceinline__ unsigned shfl_from(unsigned v, int lane) {
  return __shfl_sync(0xffffffffu, v, lane);
}
__device__ __forceinline__ u128 shfl_from(u128 v, int lane) {
  const u64 lo = __shfl_sync(0xffffffffu, u64(v), lane),
            hi = __shfl_sync(0xffffffffu, u64(v >> 64), lane);
  return (u128(hi) << 64) | u128(lo);
}

// One radix pass's digit, chosen by the 32 lanes of warp 0 together (a single thread walking
// 256 buckets, one dependent shared-memory load after another, took microseconds per pass).
// The serial rule it reproduces: b from kBuckets - 1 down to 1, stop at the first b whose
// suffix sum S(b) = sum of buckets >= b satisfies reached(S(b), total), else b = 0. That b is
// the largest b >= 1 that satisfies it, whatever `reached` is, and the sums are exact (integers
// or fixed point), so each S(b) is the serial loop's. Returns b; `above` gets S(b + 1) and
// `total` the sum of all buckets, in every lane.
template <typename T, typename BucketFn, typename Reached>
__device__ int choose_digit(const BucketFn& bucket, const Reached& reached, T& above, T& total) {
  static_assert(kBuckets % 32 == 0, "buckets split evenly over a warp");
  constexpr int kPer = kBuckets / 32;
  const int lane = int(threadIdx.x & 31);
  T local[kPer];
  T own = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) local[j] = bucket(lane * kPer + j), own += local[j];
  T incl = own;  // the buckets of lanes >= lane
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T y = shfl_down(incl, d);
    if (lane + d < 32) incl += y;
  }
  total = shfl_from(incl, 0);
  T suffix = incl - own;
  int best = 0;
  T best_above = 0;
#pragma unroll
  for (int j = kPer - 1; j >= 0; --j) {
    const int b = lane * kPer + j;
    const T excl = suffix;
    suffix += local[j];
    if (best == 0 && b >= 1 && reached(suffix, total)) best = b, best_above = excl;
    if (b == 0 && best == 0) best_above = excl;
  }
  const int chosen = int(__reduce_max_sync(0xffffffffu, unsigned(best)));
  above = shfl_from(best_above, chosen / kPer);
  return chosen;
}

// A row is split over the `parts` blocks of a thread-block cluster (several at small batch, so
// that a row is streamed by several SMs): block `rank` takes [lo, hi), lo a multiple of 4.
// Partial results are combined through distributed shared memory in rank order, and every
// combine is order-free or fixed-order, so a result does not depend on scheduling; the split
// changes no choice (see combine_in_cluster's callers).
struct RowPart {
  int lo = 0, hi = 0;
};
__device__ RowPart row_part(int n, unsigned rank, unsigned parts) {
  const int chunk = ((n + int(parts) - 1) / int(parts) + 3) & ~3;
  const int lo = min(n, int(rank) * chunk);
  return {lo, min(n, lo + chunk)};
}

template <typename F>
__device__ __forceinline__ void for_part_uniform(const float* z, RowPart part, const F& f) {
  for_each_logit_uniform(z + part.lo, part.hi - part.lo,
                         [&](int i, float x, bool ok) { f(part.lo + i, x, ok); });
}
template <typename F>
__device__ __forceinline__ void for_part(const float* z, RowPart part, const F& f) {
  for_each_logit(z + part.lo, part.hi - part.lo, [&](int i, float x) { f(part.lo + i, x); });
}

// Every block's `v` (valid in its thread 0) combined in rank order 0, 1, ...; the result in
// every thread of every block. Ends with a cluster barrier, so `slot` may be reused and the
// blocks may exit.
template <typename T, typename Op>
__device__ T combine_in_cluster(T v, T* slot, const Op& op, cg::cluster_group& cluster) {
  if (threadIdx.x == 0) *slot = v;
  cluster.sync();
  T acc = *cluster.map_shared_rank(slot, 0);
  for (unsigned r = 1; r < cluster.num_blocks(); ++r)
    acc = op(acc, *cluster.map_shared_rank(slot, r));
  cluster.sync();
  return acc;
}

// The k-th largest key of the row (1 <= k <= n): one radix digit per pass, counting the keys
// that share the digits found so far, each block its part; every block sums the histograms of
// all (integers: exact) and so chooses the same digit.
__device__ uint32_t kth_largest_key(const float* z, RowPart part, int k, SearchStorage& s,
                                    cg::cluster_group& cluster) {
  uint32_t prefix = 0, mask = 0;
  unsigned remaining = unsigned(k);
  const unsigned parts = cluster.num_blocks();
  for (int shift = 32 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    for (int b = threadIdx.x; b < kBuckets; b += blockDim.x) s.count[b] = 0;
    __syncthreads();
    for_part_uniform(z, part, [&](int, float v, bool ok) {  // whole warps call warp_count
      const uint32_t x = order_key(v);
      warp_count(s.count, ok && (x & mask) == prefix ? int((x >> shift) & (kBuckets - 1)) : -1);
    });
    cluster.sync();  // every block's histogram complete
    for (int b = threadIdx.x; b < kBuckets; b += blockDim.x) {
      unsigned c[kMaxBlocksPerRow];  // every remote load issued before the first is used
#pragma unroll
      for (unsigned r = 0; r < unsigned(kMaxBlocksPerRow); ++r)
        c[r] = r < parts ? cluster.map_shared_rank(s.count, r)[b] : 0u;
      unsigned sum = 0;
#pragma unroll
      for (int r = 0; r < kMaxBlocksPerRow; ++r) sum += c[r];
      s.count_all[b] = sum;
    }
    cluster.sync();  // every histogram read before any is cleared; the sums complete
    if (threadIdx.x < 32) {
      unsigned above, total;
      const int b = choose_digit<unsigned>(
          [&](int b) { return s.count_all[b]; },
          [&](unsigned suffix, unsigned) { return suffix >= remaining; }, above, total);
      if (threadIdx.x == 0) {
        s.prefix = prefix | (uint32_t(b) << shift);
        s.remaining = remaining - above;
      }
    }
    __syncthreads();
    prefix = s.prefix;
    remaining = s.remaining;
    mask |= uint32_t(kBuckets - 1) << shift;
  }
  return prefix;
}

// The largest key sigma of the tokens with e >= thr whose e-mass at or above sigma reaches
// top_p times their whole mass (exact fixed-point sums over the blocks' histograms).
__device__ uint32_t top_p_key(const float* z, RowPart part, float zmax, float t, double thr,
                              float top_p, SearchStorage& s, cg::cluster_group& cluster) {
  uint32_t prefix = 0, mask = 0;
  u128 above = 0;
  const float floor = scaled_floor(thr);
  const unsigned parts = cluster.num_blocks();
  for (int shift = 32 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    for (int b = threadIdx.x; b < kBuckets; b += blockDim.x) s.hi[b] = s.lo[b] = 0;
    __syncthreads();
    for_part_uniform(z, part, [&](int, float x, bool ok) {  // whole warps call warp_weigh
      int bucket = -1;
      u128 v = 0;
      if (ok) {
        const uint32_t key = order_key(x);
        const float sx = scaled(x, zmax, t);
        if ((key & mask) == prefix && !(sx < floor)) {
          const double e = exp(double(sx));
          if (e >= thr) bucket = int((key >> shift) & (kBuckets - 1)), v = to_fixed(e);
        }
      }
      warp_weigh(s.hi, s.lo, bucket, v);
    });
    cluster.sync();  // every block's histogram complete
    for (int b = threadIdx.x; b < kBuckets; b += blockDim.x) {
      u128 w[kMaxBlocksPerRow];  // every remote load issued before the first is used
#pragma unroll
      for (unsigned r = 0; r < unsigned(kMaxBlocksPerRow); ++r)
        w[r] = r < parts ? (u128(cluster.map_shared_rank(s.hi, r)[b]) << 64) |
                               u128(cluster.map_shared_rank(s.lo, r)[b])
                         : u128(0);
      u128 sum = 0;
#pragma unroll
      for (int r = 0; r < kMaxBlocksPerRow; ++r) sum += w[r];
      s.hi_all[b] = u64(sum >> 64);
      s.lo_all[b] = u64(sum);
    }
    cluster.sync();  // every histogram read before any is cleared; the sums complete
    if (threadIdx.x < 32) {
      // The first pass sees every kept token: its total is the kept mass.
      const bool first = shift == 32 - kDigitBits;
      const double old_target = s.target;
      u128 higher, total;
      const int b = choose_digit<u128>(
          [&](int b) { return (u128(s.hi_all[b]) << 64) | u128(s.lo_all[b]); },
          [&](u128 suffix, u128 mass) {
            const double target = first ? double(top_p) * fixed_to_double(mass) : old_target;
            return fixed_to_double(above + suffix) >= target;
          },
          higher, total);
      if (threadIdx.x == 0) {
        if (first) s.target = double(top_p) * fixed_to_double(total);
        const u128 cum = above + higher;
        s.prefix = prefix | (uint32_t(b) << shift);
        s.above_hi = u64(cum >> 64);
        s.above_lo = u64(cum);
      }
    }
    __syncthreads();
    prefix = s.prefix;
    above = (u128(s.above_hi) << 64) | u128(s.above_lo);
    mask |= uint32_t(kBuckets - 1) << shift;
  }
  return prefix;
}

struct BadMax {
  int bad;
  float m;
};

// Kernel 1: per row (one cluster), the non-finite scan and the raw row's statistics.
__global__ void __launch_bounds__(kThreads) row_stats_kernel(SamplingLaunch p) {
  __shared__ TempStorage tmp;
  __shared__ SearchStorage search;
  __shared__ BadMax s_badmax;
  __shared__ double s_sum;
  __shared__ int s_count, s_ties;
  __shared__ int cand_ids[kMaxTopLogprobs];
  __shared__ int tie_ids[kTieCapacity];
  // Rank 0's gathering of every block's candidates.
  __shared__ int all_cand[kMaxTopLogprobs];
  __shared__ int all_ties[kTieCapacity];
  __shared__ int s_above, s_all_ties, s_collected;
  __shared__ int part_count[kMaxBlocksPerRow], part_ties[kMaxBlocksPerRow];
  __shared__ int cand_at[kMaxBlocksPerRow], tie_at[kMaxBlocksPerRow];
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned parts = cluster.num_blocks(), rank = cluster.block_rank();
  const int r = int(blockIdx.x / parts);
  const int n = p.vocab;
  const float* z = p.logits + size_t(r) * size_t(n);
  const RowPart part = row_part(n, rank, parts);
  const SamplingRowTask task = p.row_tasks[r];
  SamplingRowResult& out = p.row_results[r];

  int bad = INT_MAX;
  float m = -INFINITY;
  for_part(z, part, [&](int i, float x) {
    if (non_finite(x)) bad = min(bad, i);
    m = fmaxf(m, x);
  });
  bad = ReduceInt(tmp.i).Reduce(bad, MinInt());
  __syncthreads();
  m = ReduceFloat(tmp.f).Reduce(m, MaxFloat());
  const BadMax bm = combine_in_cluster(
      BadMax{bad, m}, &s_badmax,
      [](const BadMax& a, const BadMax& b) {
        return BadMax{min(a.bad, b.bad), fmaxf(a.m, b.m)};
      },
      cluster);
  bad = bm.bad;
  m = bm.m;
  if (rank == 0 && threadIdx.x == 0) {
    out.nonfinite_index = bad == INT_MAX ? -1 : bad;
    out.nonfinite_value = bad == INT_MAX ? 0.0f : z[bad];
    out.score_logprob = 0;
    out.top_count = 0;
    out.lse = 0;
  }
  if (bad != INT_MAX || !task.need_lse) return;  // the same in every block

  // log-sum-exp as cpu::score_row: m + log(sum exp(double(z) - double(m))); the sum per thread,
  // a tree per block, then the blocks in rank order.
  double sum = 0;
  for_part(z, part, [&](int, float x) { sum += exp(double(x) - double(m)); });
  sum = ReduceDouble(tmp.d).Sum(sum);
  sum = combine_in_cluster(
      sum, &s_sum, [](double a, double b) { return a + b; }, cluster);
  const double lse = double(m) + log(sum);
  if (rank == 0 && threadIdx.x == 0) {
    out.lse = lse;
    if (task.score_id >= 0) out.score_logprob = float(double(z[task.score_id]) - lse);
  }
  if (task.top_n <= 0) return;

  // The top_n largest: the top_n-th key, the keys above it, then its ties in index order.
  const int k = min(task.top_n, n);
  const uint32_t tau = kth_largest_key(z, part, k, search, cluster);
  if (threadIdx.x == 0) s_count = 0, s_ties = 0;
  __syncthreads();
  // Per block: the keys above tau (fewer than k in all), and its ties while they fit.
  for_part(z, part, [&](int i, float x) {
    const uint32_t key = order_key(x);
    if (key > tau) {
      cand_ids[atomicAdd(&s_count, 1)] = i;
    } else if (key == tau) {
      const int t = atomicAdd(&s_ties, 1);
      if (t < kTieCapacity) tie_ids[t] = i;
    }
  });
  cluster.sync();
  if (rank == 0) {
    // Rank 0 gathers: each block's counts, their offsets, then the ids (in parallel).
    if (threadIdx.x < parts) {
      part_count[threadIdx.x] = *cluster.map_shared_rank(&s_count, threadIdx.x);
      part_ties[threadIdx.x] = *cluster.map_shared_rank(&s_ties, threadIdx.x);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int above = 0, ties = 0;
      for (unsigned q = 0; q < parts; ++q) {
        cand_at[q] = above, tie_at[q] = ties;
        above += part_count[q];
        ties += part_ties[q];
      }
      s_above = above;
      s_all_ties = ties;
      s_collected = ties <= kTieCapacity ? 1 : 0;  // then every block kept all its ties
    }
    __syncthreads();
    for (int j = threadIdx.x; j < int(parts) * kMaxTopLogprobs; j += blockDim.x) {
      const int q = j / kMaxTopLogprobs, a = j % kMaxTopLogprobs;
      if (a < part_count[q]) all_cand[cand_at[q] + a] = cluster.map_shared_rank(cand_ids, q)[a];
    }
    for (int j = threadIdx.x; s_collected && j < int(parts) * kTieCapacity; j += blockDim.x) {
      const int q = j / kTieCapacity, a = j % kTieCapacity;
      if (a < part_ties[q]) all_ties[tie_at[q] + a] = cluster.map_shared_rank(tie_ids, q)[a];
    }
  }
  cluster.sync();  // every block's candidates read: the others may exit
  if (rank != 0) return;
  const int above = s_above;
  const int need = k - above;
  const bool collected = s_collected != 0;
  if (collected) {
    // All ties collected (the usual case: one): the `need` lowest indices.
    if (threadIdx.x == 0) {
      const int ties = s_all_ties;
      for (int a = 1; a < ties; ++a) {
        const int id = all_ties[a];
        int b = a - 1;
        for (; b >= 0 && all_ties[b] > id; --b) all_ties[b + 1] = all_ties[b];
        all_ties[b + 1] = id;
      }
      for (int a = 0; a < need; ++a) all_cand[above + a] = all_ties[a];
    }
  }
  // More ties than collected: an ordered scan of the whole row for the lowest indices.
  int taken = 0;
  for (int base = 0; !collected && base < n && taken < need; base += blockDim.x) {
    const int i = base + int(threadIdx.x);
    const int tie = i < n && order_key(z[i]) == tau ? 1 : 0;
    int rank_in, total;
    ScanInt(tmp.scan).ExclusiveSum(tie, rank_in, total);
    if (tie && taken + rank_in < need) all_cand[above + taken + rank_in] = i;
    taken += total;
    __syncthreads();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // Larger first, ties to the lower index (insertion sort of at most kMaxTopLogprobs).
    for (int a = 1; a < k; ++a) {
      const int id = all_cand[a];
      const uint32_t key = order_key(z[id]);
      int b = a - 1;
      for (; b >= 0; --b) {
        const uint32_t kb = order_key(z[all_cand[b]]);
        if (kb > key || (kb == key && all_cand[b] < id)) break;
        all_cand[b + 1] = all_cand[b];
      }
      all_cand[b + 1] = id;
    }
    for (int a = 0; a < k; ++a) {
      out.top_ids[a] = all_cand[a];
      out.top_logprobs[a] = float(double(z[all_cand[a]]) - lse);
    }
    out.top_count = k;
  }
}
// Kernel 2: the patched tokens of sampled rows, raw values saved.
__global__ void patch_kernel(SamplingLaunch p) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.num_patch_tokens) return;
  const SamplingPatchToken t = p.patch_tokens[j];
  float* zp = p.logits + size_t(t.row) * size_t(p.vocab) + t.token;
  float z = *zp;
  p.saved_raw[j] = z;
  for (int o = t.op_begin; o < t.op_end; ++o) {
    const SamplingPatchOp op = p.patch_ops[o];
    if (op.kind == kPatchAdd)
      z = __fadd_rn(z, op.value);
    else if (op.kind == kPatchRepetition)
      z = z > 0 ? __fdiv_rn(z, op.value) : __fmul_rn(z, op.value);
    else
      z = __fsub_rn(z, op.value);
  }
  *zp = z;
}

// Kernel 3: per sampled row (one cluster), the choice and its logprob.
__global__ void __launch_bounds__(kThreads) sample_kernel(SamplingLaunch p) {
  __shared__ TempStorage tmp;
  __shared__ SearchStorage search;
  __shared__ KeyIndex s_best;
  __shared__ RaceValue s_race;
  __shared__ int s_id;
  __shared__ float s_raw;
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned parts = cluster.num_blocks(), rank = cluster.block_rank();
  const int si = int(blockIdx.x / parts);
  const SamplingSampleTask task = p.samples[si];
  const int n = p.vocab;
  const float* z = p.logits + size_t(task.row) * size_t(n);
  const RowPart part = row_part(n, rank, parts);
  const SamplingRowResult& stats = p.row_results[task.row];
  SamplingSampleResult& out = p.sample_results[si];
  if (stats.nonfinite_index >= 0) {  // the same in every block
    if (rank == 0 && threadIdx.x == 0) out.id = -1, out.logprob = 0;
    return;
  }
  if (task.forced >= 0) {
    if (rank != 0) return;  // nothing to search: rank 0 alone reports
    if (threadIdx.x == 0) s_id = task.forced;
  } else {
    // The first index of the largest (patched) logit: per thread, per block, then the blocks.
    KeyIndex best{0, INT_MAX};
    for_part(z, part, [&](int i, float x) {
      const uint32_t key = order_key(x);
      if (best.index == INT_MAX || key > best.key || (key == best.key && i < best.index))
        best = {key, i};
    });
    best = ReduceKey(tmp.key).Reduce(best, LargerKeyFirstIndex());
    best = combine_in_cluster(best, &s_best, LargerKeyFirstIndex(), cluster);
    int id = best.index;
    if (task.temperature > 0) {
      const float t = task.temperature;
      const float zmax = z[id];
      double thr = task.min_p > 0 ? double(task.min_p) : 0.0;
      if (task.top_k > 0 && task.top_k < n) {
        const uint32_t kk = kth_largest_key(z, part, task.top_k, search, cluster);
        thr = fmax(thr, weight(key_value(kk), zmax, t));
      }
      if (task.top_p < 1) {
        const uint32_t sigma = top_p_key(z, part, zmax, t, thr, task.top_p, search, cluster);
        thr = fmax(thr, weight(key_value(sigma), zmax, t));
      }
      // The exponential race among the kept tokens. Per thread: the larger value, ties to the
      // lower index (NaN never wins), as the reference's ascending scan with a strict
      // comparison; then the block, then the blocks.
      RaceValue race{-1.0, INT_MAX};
      const float floor = scaled_floor(thr);
      for_part(z, part, [&](int i, float x) {
        const float sx = scaled(x, zmax, t);
        if (sx < floor) return;
        const double e = exp(double(sx));
        if (!(e >= thr)) return;
        const double v = e / -log(sample_uniform(task.seed, task.index, i));
        if (v > race.v || (v == race.v && i < race.index)) race = {v, i};
      });
      __syncthreads();  // tmp was last used by the argmax's reduction
      race = ReduceRace(tmp.race).Reduce(race, LargerValueFirstIndex());
      race = combine_in_cluster(race, &s_race, LargerValueFirstIndex(), cluster);
      id = race.index == INT_MAX ? -1 : race.index;
    }
    if (rank != 0) return;  // every remote read is done (combine_in_cluster ends synced)
    if (threadIdx.x == 0) s_id = id;
  }
  __syncthreads();
  const int id = s_id;
  if (!task.want_logprob || id < 0) {
    if (threadIdx.x == 0) out.id = id, out.logprob = 0;
    return;
  }
  // The raw logit of the chosen id: saved by the patch kernel when it was patched.
  if (threadIdx.x == 0) s_raw = z[id];
  __syncthreads();
  for (int j = task.patch_begin + int(threadIdx.x); j < task.patch_end; j += blockDim.x)
    if (p.patch_tokens[j].token == id) s_raw = p.saved_raw[j];
  __syncthreads();
  if (threadIdx.x == 0) {
    out.id = id;
    out.logprob = float(double(s_raw) - stats.lse);
  }
}

// Blocks per row: enough to give every SM a share of the rows at small batch, at most the
// portable cluster size.
unsigned blocks_per_row(int rows) {
  return unsigned(std::clamp(sm_count() / std::max(rows, 1), 1, kMaxBlocksPerRow));
}

void launch_clustered(void (*kernel)(SamplingLaunch), int rows, const SamplingLaunch& p,
                      cudaStream_t stream) {
  const unsigned parts = blocks_per_row(rows);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(rows) * parts);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = parts;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  DSV4_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

}  // namespace

void sample_rows(const SamplingLaunch& p, cudaStream_t stream) {
  DSV4_CHECK(p.vocab > 0, "sampling: vocab must be positive");
  DSV4_CHECK(p.rows >= 0 && p.num_samples >= 0 && p.num_patch_tokens >= 0 && p.num_patch_ops >= 0,
             "sampling: negative sizes");
  DSV4_CHECK(p.num_samples <= p.rows, "sampling: ", p.num_samples, " samples over ", p.rows,
             " rows");
  if (p.rows == 0) return;
  DSV4_CHECK(p.logits && p.row_tasks && p.row_results, "sampling: null logits, tasks or results");
  DSV4_CHECK(p.num_samples == 0 || (p.samples && p.sample_results),
             "sampling: null sample tasks or results");
  DSV4_CHECK(p.num_patch_tokens == 0 || (p.patch_tokens && p.saved_raw && p.patch_ops),
             "sampling: null patch arrays");
  launch_clustered(row_stats_kernel, p.rows, p, stream);
  if (p.num_patch_tokens > 0) {
    patch_kernel<<<(p.num_patch_tokens + kPatchThreads - 1) / kPatchThreads, kPatchThreads, 0,
                   stream>>>(p);
    DSV4_CUDA_CHECK(cudaGetLastError());
  }
  if (p.num_samples > 0) launch_clustered(sample_kernel, p.num_samples, p, stream);
}

}  // namespace dsv4::cuda
