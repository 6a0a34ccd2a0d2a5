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
//  - the log-sum-exp of the logprobs (fp64, per-thread sums then a tree): see the test for the
//    bound; it does not affect any choice.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cstdint>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/sampling/sampling.h"
#include "ops/cuda/sampling/sampling_config.h"

namespace dsv4::cuda {
namespace {

using namespace sampling_cfg;
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
  unsigned count[kBuckets];
  u64 hi[kBuckets], lo[kBuckets];
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

// The k-th largest key among key(i), i in [0, n) (1 <= k <= n): one radix digit per pass,
// counting the keys that share the digits found so far.
__device__ uint32_t kth_largest_key(const float* z, int n, int k, SearchStorage& s) {
  uint32_t prefix = 0, mask = 0;
  unsigned remaining = unsigned(k);
  for (int shift = 32 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    for (int b = threadIdx.x; b < kBuckets; b += blockDim.x) s.count[b] = 0;
    __syncthreads();
    for_each_logit_uniform(z, n, [&](int, float v, bool ok) {  // whole warps call warp_count
      const uint32_t x = order_key(v);
      warp_count(s.count, ok && (x & mask) == prefix ? int((x >> shift) & (kBuckets - 1)) : -1);
    });
    __syncthreads();
    if (threadIdx.x < 32) {
      unsigned above, total;
      const int b = choose_digit<unsigned>(
          [&](int b) { return s.count[b]; },
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
    __syncthreads();
  }
  return prefix;
}

// The largest key sigma of the tokens with e >= thr whose e-mass at or above sigma reaches
// top_p times their whole mass.
__device__ uint32_t top_p_key(const float* z, int n, float zmax, float t, double thr, float top_p,
                              SearchStorage& s) {
  uint32_t prefix = 0, mask = 0;
  u128 above = 0;
  const float floor = scaled_floor(thr);
  for (int shift = 32 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    for (int b = threadIdx.x; b < kBuckets; b += blockDim.x) s.hi[b] = s.lo[b] = 0;
    __syncthreads();
    for_each_logit_uniform(z, n, [&](int, float x, bool ok) {  // whole warps call warp_weigh
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
    __syncthreads();
    if (threadIdx.x < 32) {
      // The first pass sees every kept token: its total is the kept mass.
      const bool first = shift == 32 - kDigitBits;
      const double old_target = s.target;
      u128 higher, total;
      const int b = choose_digit<u128>(
          [&](int b) { return (u128(s.hi[b]) << 64) | u128(s.lo[b]); },
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
    __syncthreads();
  }
  return prefix;
}

// Kernel 1: per row, the non-finite scan and the raw row's statistics.
__global__ void __launch_bounds__(kThreads) row_stats_kernel(SamplingLaunch p) {
  __shared__ TempStorage tmp;
  __shared__ SearchStorage search;
  __shared__ int s_int;
  __shared__ float s_float;
  __shared__ int s_count;
  __shared__ int cand_ids[kMaxTopLogprobs];
  __shared__ int tie_ids[kTieCapacity];
  __shared__ int s_ties;
  const int r = blockIdx.x;
  const int n = p.vocab;
  const float* z = p.logits + size_t(r) * size_t(n);
  const SamplingRowTask task = p.row_tasks[r];
  SamplingRowResult& out = p.row_results[r];

  int bad = INT_MAX;
  float m = -INFINITY;
  for_each_logit(z, n, [&](int i, float x) {
    if (non_finite(x)) bad = min(bad, i);
    m = fmaxf(m, x);
  });
  bad = ReduceInt(tmp.i).Reduce(bad, MinInt());
  if (threadIdx.x == 0) s_int = bad;
  __syncthreads();
  bad = s_int;
  m = ReduceFloat(tmp.f).Reduce(m, MaxFloat());
  if (threadIdx.x == 0) {
    s_float = m;
    out.nonfinite_index = bad == INT_MAX ? -1 : bad;
    out.nonfinite_value = bad == INT_MAX ? 0.0f : z[bad];
    out.score_logprob = 0;
    out.top_count = 0;
    out.lse = 0;
  }
  __syncthreads();
  m = s_float;
  if (bad != INT_MAX || !task.need_lse) return;

  // log-sum-exp as cpu::score_row: m + log(sum exp(double(z) - double(m))).
  double sum = 0;
  for_each_logit(z, n, [&](int, float x) { sum += exp(double(x) - double(m)); });
  sum = ReduceDouble(tmp.d).Sum(sum);
  __shared__ double s_lse;
  if (threadIdx.x == 0) {
    s_lse = double(m) + log(sum);
    out.lse = s_lse;
    if (task.score_id >= 0) out.score_logprob = float(double(z[task.score_id]) - s_lse);
  }
  __syncthreads();
  const double lse = s_lse;
  if (task.top_n <= 0) return;

  // The top_n largest: the top_n-th key, the keys above it, then its ties in index order.
  const int k = min(task.top_n, n);
  const uint32_t tau = kth_largest_key(z, n, k, search);
  if (threadIdx.x == 0) s_count = 0, s_ties = 0;
  __syncthreads();
  // The keys above tau (fewer than k), and the indices of its ties while they fit.
  for_each_logit(z, n, [&](int i, float x) {
    const uint32_t key = order_key(x);
    if (key > tau) {
      cand_ids[atomicAdd(&s_count, 1)] = i;
    } else if (key == tau) {
      const int t = atomicAdd(&s_ties, 1);
      if (t < kTieCapacity) tie_ids[t] = i;
    }
  });
  __syncthreads();
  const int above = s_count;
  const int need = k - above;
  const int ties = s_ties;
  if (ties <= kTieCapacity) {
    // All ties collected (the usual case: one): the `need` lowest indices.
    if (threadIdx.x == 0) {
      for (int a = 1; a < ties; ++a) {
        const int id = tie_ids[a];
        int b = a - 1;
        for (; b >= 0 && tie_ids[b] > id; --b) tie_ids[b + 1] = tie_ids[b];
        tie_ids[b + 1] = id;
      }
      for (int a = 0; a < need; ++a) cand_ids[above + a] = tie_ids[a];
    }
  }
  // More ties than collected: an ordered scan for the lowest indices.
  int taken = 0;
  for (int base = 0; ties > kTieCapacity && base < n && taken < need; base += blockDim.x) {
    const int i = base + int(threadIdx.x);
    const int tie = i < n && order_key(z[i]) == tau ? 1 : 0;
    int rank, total;
    ScanInt(tmp.scan).ExclusiveSum(tie, rank, total);
    if (tie && taken + rank < need) cand_ids[above + taken + rank] = i;
    taken += total;
    __syncthreads();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // Larger first, ties to the lower index (insertion sort of at most kMaxTopLogprobs).
    for (int a = 1; a < k; ++a) {
      const int id = cand_ids[a];
      const uint32_t key = order_key(z[id]);
      int b = a - 1;
      for (; b >= 0; --b) {
        const uint32_t kb = order_key(z[cand_ids[b]]);
        if (kb > key || (kb == key && cand_ids[b] < id)) break;
        cand_ids[b + 1] = cand_ids[b];
      }
      cand_ids[b + 1] = id;
    }
    for (int a = 0; a < k; ++a) {
      out.top_ids[a] = cand_ids[a];
      out.top_logprobs[a] = float(double(z[cand_ids[a]]) - lse);
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

// Kernel 3: per sampled row, the choice and its logprob.
__global__ void __launch_bounds__(kThreads) sample_kernel(SamplingLaunch p) {
  __shared__ TempStorage tmp;
  __shared__ SearchStorage search;
  __shared__ int s_id;
  __shared__ float s_raw;
  const SamplingSampleTask task = p.samples[blockIdx.x];
  const int n = p.vocab;
  const float* z = p.logits + size_t(task.row) * size_t(n);
  const SamplingRowResult& stats = p.row_results[task.row];
  SamplingSampleResult& out = p.sample_results[blockIdx.x];
  if (stats.nonfinite_index >= 0) {
    if (threadIdx.x == 0) out.id = -1, out.logprob = 0;
    return;
  }
  if (task.forced >= 0) {
    if (threadIdx.x == 0) s_id = task.forced;
  } else {
    // The first index of the largest (patched) logit.
    KeyIndex best{0, INT_MAX};
    for_each_logit(z, n, [&](int i, float x) {
      const uint32_t key = order_key(x);
      if (best.index == INT_MAX || key > best.key || (key == best.key && i < best.index))
        best = {key, i};
    });
    best = ReduceKey(tmp.key).Reduce(best, LargerKeyFirstIndex());
    if (threadIdx.x == 0) s_id = best.index;
    __syncthreads();
    if (task.temperature > 0) {
      const float t = task.temperature;
      const float zmax = z[s_id];
      double thr = task.min_p > 0 ? double(task.min_p) : 0.0;
      if (task.top_k > 0 && task.top_k < n) {
        const uint32_t kk = kth_largest_key(z, n, task.top_k, search);
        thr = fmax(thr, weight(key_value(kk), zmax, t));
      }
      if (task.top_p < 1) {
        const uint32_t sigma = top_p_key(z, n, zmax, t, thr, task.top_p, search);
        thr = fmax(thr, weight(key_value(sigma), zmax, t));
      }
      // The exponential race among the kept tokens.
      RaceValue race{-1.0, INT_MAX};
      const float floor = scaled_floor(thr);
      // Per thread: the larger value, ties to the lower index (NaN never wins), as the
      // reference's ascending scan with a strict comparison.
      for_each_logit(z, n, [&](int i, float x) {
        const float sx = scaled(x, zmax, t);
        if (sx < floor) return;
        const double e = exp(double(sx));
        if (!(e >= thr)) return;
        const double v = e / -log(sample_uniform(task.seed, task.index, i));
        if (v > race.v || (v == race.v && i < race.index)) race = {v, i};
      });
      race = ReduceRace(tmp.race).Reduce(race, LargerValueFirstIndex());
      __syncthreads();
      if (threadIdx.x == 0) s_id = race.index == INT_MAX ? -1 : race.index;
    }
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
  row_stats_kernel<<<p.rows, kThreads, 0, stream>>>(p);
  DSV4_CUDA_CHECK(cudaGetLastError());
  if (p.num_patch_tokens > 0) {
    patch_kernel<<<(p.num_patch_tokens + kPatchThreads - 1) / kPatchThreads, kPatchThreads, 0,
                   stream>>>(p);
    DSV4_CUDA_CHECK(cudaGetLastError());
  }
  if (p.num_samples > 0) {
    sample_kernel<<<p.num_samples, kThreads, 0, stream>>>(p);
    DSV4_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace dsv4::cuda
