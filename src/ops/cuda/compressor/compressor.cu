// Compressor kernels: state update, pooling, RMSNorm, RoPE, FP8 / Hadamard+MXFP4 quantisation
// and insertion, reproducing the CPU's sequential per-token processing exactly.
//
// Which rows a block pools. With P0 the chunk's first position, a token at position q < P0 is
// read from the incoming state, q >= P0 from the chunk's a/g rows (score = g + ape[q % r],
// the same fp32 add compressor_store does):
//  - ratio 128, block b: token b*128 + t in state row t;
//  - ratio 4, block b: its tokens (B half of the channels) in the current rows 4 + t; the
//    previous block b-1 (A half) is in the current rows too if it is the block open at P0
//    (b-1 == P0/4), otherwise it completed before the chunk and sits in the previous rows
//    (for b == 0 those hold the reset values: kv 0, score -inf).
// The outgoing state is what the CPU leaves: each current row holds the last token with that
// residue; for ratio 4 the previous rows hold the last block completed in the chunk (copied
// from the current rows at that moment), untouched if none completed.
// Pooling never writes the state and the state update runs after every read of the incoming
// state (later in the fused kernel, a later kernel in the split path), so the kernels are free
// of read/write races.
#include "ops/cuda/compressor/compressor.h"

#include <cooperative_groups.h>

#include <cstdint>

#include "core/error.h"
#include "kvcache/cache_layout.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/glibc_expf.cuh"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/numerics.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/compressor/compressor_config.h"

namespace dsv4::cuda {
namespace {

namespace cg = cooperative_groups;

struct SeqInfo {
  int row0 = 0;  // first token row of the chunk
  int n = 0;     // chunk length
  int p0 = 0;    // first position
  float* state = nullptr;
};

template <class Cfg>
__device__ __forceinline__ SeqInfo seq_info(const CompressorParams& p, int s) {
  constexpr int64_t kStateFloats = 2 * int64_t(Cfg::kRows) * Cfg::kWidth;
  SeqInfo si;
  si.row0 = p.cu_seqlens[s];
  si.n = p.cu_seqlens[s + 1] - si.row0;
  si.p0 = p.start_pos[s];
  si.state = p.states + int64_t(p.state_slot[s]) * kStateFloats;
  return si;
}

template <class Cfg>
__device__ __forceinline__ int blocks_completing(int p0, int n) {
  return (p0 + n) / Cfg::kRatio - p0 / Cfg::kRatio;
}

__device__ __forceinline__ float4 ld4(const float* p) {
  return __ldg(reinterpret_cast<const float4*>(p));
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z),
                     __fadd_rn(a.w, b.w));
}
__device__ __forceinline__ void st4(float* p, float4 v) {
  *reinterpret_cast<float4*>(p) = v;
}

// The kv value and score of token row t of block b at state column `col` (see the header).
template <class Cfg>
__device__ __forceinline__ void load_row(const CompressorParams& p, const SeqInfo& si, int b, int t,
                                         int col, float4& kv, float4& sc) {
  int pos, state_row = t;
  if constexpr (Cfg::kRatio == 4) {
    if (t < 4) {
      pos = (b - 1) * 4 + t;
      if (b - 1 >= si.p0 / 4) state_row = 4 + t;  // block b-1 still open at P0
    } else {
      pos = b * 4 + (t - 4);
      col += Cfg::kDim;  // this block's tokens contribute their B half
    }
  } else {
    pos = b * Cfg::kRatio + t;
  }
  if (pos >= si.p0) {
    const int64_t r = si.row0 + (pos - si.p0);
    kv = ld4(p.a + r * p.a_stride + col);
    sc = add4(ld4(p.g + r * p.g_stride + col),
              ld4(p.ape + int64_t(pos % Cfg::kRatio) * Cfg::kWidth + col));
  } else {
    kv = *reinterpret_cast<const float4*>(si.state + int64_t(state_row) * Cfg::kWidth + col);
    sc = *reinterpret_cast<const float4*>(si.state + int64_t(Cfg::kRows + state_row) * Cfg::kWidth +
                                          col);
  }
}

template <class Cfg>
struct Smem {
  float* kv;   // [kRows][kTile]
  float* sc;   // [kRows][kTile]
  float* mx;   // [kParts][kTile]
  float* sum;  // [kTile]
  float* y;    // [kTile]
  __device__ explicit Smem(float* base)
      : kv(base),
        sc(base + Cfg::kRows * Cfg::kTile),
        mx(base + 2 * Cfg::kRows * Cfg::kTile),
        sum(mx + Cfg::kParts * Cfg::kTile),
        y(sum + Cfg::kTile) {}
};

// Sum of one double per thread over the CTA, returned to every thread (fixed order).
template <class Cfg>
__device__ __forceinline__ double block_sum_d(double v, double* red) {
  v = num::warp_sum_d(v);
  const int warp = threadIdx.x >> 5;
  __syncthreads();  // red may still be read from a previous call
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  double t = 0.0;
#pragma unroll
  for (int w = 0; w < Cfg::kWarps; ++w) t = __dadd_rn(t, red[w]);
  return t;
}

// Pools block b of sequence si over this CTA's channels [c0, c0 + kTile), finishes the entry
// (cluster-wide RMSNorm) and writes this CTA's part of entry b of block-table row s.
template <class Cfg>
__device__ __forceinline__ void pool_block(const CompressorParams& p, int s, const SeqInfo& si,
                                           int b, int rank, const Smem<Cfg>& sm, double* red,
                                           double* part) {
  constexpr int kTile = Cfg::kTile, kRows = Cfg::kRows, kQ = kTile / 4;
  constexpr int kPer = kRows * kQ / Cfg::kThreads;
  const int tid = threadIdx.x;
  const int c0 = rank * kTile;

  // 1. Rows -> shared memory; all loads of a thread in flight together.
  {
    float4 kv[kPer], sc[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = tid + i * Cfg::kThreads;
      load_row<Cfg>(p, si, b, idx / kQ, c0 + 4 * (idx % kQ), kv[i], sc[i]);
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = tid + i * Cfg::kThreads;
      st4(sm.kv + (idx / kQ) * kTile + 4 * (idx % kQ), kv[i]);
      st4(sm.sc + (idx / kQ) * kTile + 4 * (idx % kQ), sc[i]);
    }
  }
  __syncthreads();

  // 2. Per-channel softmax over the rows, in the CPU's order where the order matters:
  // max (order-free), exp (elementwise), sum (sequential), weights (elementwise), weighted
  // sum (sequential).
  for (int task = tid; task < kTile * Cfg::kParts; task += Cfg::kThreads) {
    const int ch = task % kTile, part = task / kTile;
    float m = -__uint_as_float(0x7f800000u);
    for (int t = part * Cfg::kRowsPerPart; t < (part + 1) * Cfg::kRowsPerPart; ++t)
      m = fmaxf(m, sm.sc[t * kTile + ch]);
    sm.mx[part * kTile + ch] = m;
  }
  __syncthreads();
  for (int task = tid; task < kTile * Cfg::kParts; task += Cfg::kThreads) {
    const int ch = task % kTile, part = task / kTile;
    float m = sm.mx[ch];
#pragma unroll
    for (int q = 1; q < Cfg::kParts; ++q) m = fmaxf(m, sm.mx[q * kTile + ch]);
    for (int t = part * Cfg::kRowsPerPart; t < (part + 1) * Cfg::kRowsPerPart; ++t)
      sm.sc[t * kTile + ch] = num::glibc_expf(__fsub_rn(sm.sc[t * kTile + ch], m));
  }
  __syncthreads();
  for (int ch = tid; ch < kTile; ch += Cfg::kThreads) {
    float sum = 0.0f;
    for (int t = 0; t < kRows; ++t) sum = __fadd_rn(sum, sm.sc[t * kTile + ch]);
    sm.sum[ch] = sum;
  }
  __syncthreads();
  for (int task = tid; task < kTile * Cfg::kParts; task += Cfg::kThreads) {
    const int ch = task % kTile, part = task / kTile;
    const float sum = sm.sum[ch];
    for (int t = part * Cfg::kRowsPerPart; t < (part + 1) * Cfg::kRowsPerPart; ++t)
      sm.sc[t * kTile + ch] = __fdiv_rn(sm.sc[t * kTile + ch], sum);
  }
  __syncthreads();
  double ss = 0.0;
  for (int ch = tid; ch < kTile; ch += Cfg::kThreads) {
    float acc = 0.0f;
    for (int t = 0; t < kRows; ++t)
      acc = __fadd_rn(acc, __fmul_rn(sm.kv[t * kTile + ch], sm.sc[t * kTile + ch]));
    const float x = num::bf16r(acc);  // compressor_finish: pooled -> BF16
    sm.y[ch] = x;
    ss = __dadd_rn(ss, __dmul_rn(double(x), double(x)));
  }

  // 3. RMSNorm over all d channels: the CTA partials meet through DSMEM in rank order.
  ss = block_sum_d<Cfg>(ss, red);
  if constexpr (Cfg::kCluster > 1) {
    cg::cluster_group cluster = cg::this_cluster();
    if (tid == 0) *part = ss;
    cluster.sync();
    ss = 0.0;
#pragma unroll
    for (int r = 0; r < Cfg::kCluster; ++r) ss = __dadd_rn(ss, *cluster.map_shared_rank(part, r));
    cluster.sync();  // no CTA leaves or reuses `part` while another still reads it
  }
  const float ms = float(__ddiv_rn(ss, double(Cfg::kDim)));
  const float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, p.eps)));
  for (int ch = tid; ch < kTile; ch += Cfg::kThreads) {
    const float w = __bfloat162float(p.norm_weight[c0 + ch]);
    sm.y[ch] = num::bf16r(__fmul_rn(w, __fmul_rn(sm.y[ch], rs)));
  }
  __syncthreads();

  // 4. RoPE of the last 64 channels at the block's first position.
  if (c0 + kTile == Cfg::kDim && tid < 32) {
    const float2 cs = num::rope_cos_sin(b * Cfg::kRatio, p.inv_freq[tid]);
    const int ch = kTile - 64 + 2 * tid;
    float a = sm.y[ch], bb = sm.y[ch + 1];
    num::rope_pair(a, bb, cs, false);
    sm.y[ch] = a;
    sm.y[ch + 1] = bb;
  }
  __syncthreads();

  uint8_t* data = entry_data(p.store, s, b);
  uint8_t* scales = entry_scales(p.store, s, b);
  const int lane = tid & 31, warp = tid >> 5;
  if constexpr (Cfg::kIndexer) {
    // 5a. Hadamard (Sylvester order, fp32 butterflies), x 128^-1/2, BF16; then MXFP4 per 32.
    static_assert(kTile == 128 && Cfg::kThreads == 128, "indexer tile");
    for (int h = 1; h < 128; h *= 2) {
      if (tid < 64) {
        const int i = (tid / h) * 2 * h + (tid % h);
        const float a = sm.y[i], bb = sm.y[i + h];
        sm.y[i] = __fadd_rn(a, bb);
        sm.y[i + h] = __fsub_rn(a, bb);
      }
      __syncthreads();
    }
    const float hs = float(__ddiv_rn(1.0, __dsqrt_rn(128.0)));
    const float v = num::bf16r(__fmul_rn(sm.y[tid], hs));
    const float amax = num::warp_max_f(fabsf(v));
    const float sc = num::fp4_scale_from_amax(amax);
    const uint32_t code = num::e2m1_code(v, sc);
    const uint32_t next = __shfl_down_sync(0xffffffffu, code, 1);
    if ((lane & 1) == 0) data[tid / 2] = uint8_t(code | (next << 4));
    if (lane == 0) scales[warp] = num::pow2_to_e8m0(sc);
  } else {
    // 5b. FP8 e4m3 per 64 channels below 448, BF16 RoPE above: one warp per 64 channels.
    for (int blk = warp; blk < kTile / 64; blk += Cfg::kWarps) {
      const int gch = c0 + 64 * blk;
      const float v0 = sm.y[64 * blk + 2 * lane], v1 = sm.y[64 * blk + 2 * lane + 1];
      if (gch < 448) {
        const float amax = num::warp_max_f(fmaxf(fabsf(v0), fabsf(v1)));
        const float sc = num::fp8_scale_from_amax(amax);
        *reinterpret_cast<uint16_t*>(data + gch + 2 * lane) = num::e4m3x2(v0, v1, sc);
        if (lane == 0) scales[gch / 64] = num::pow2_to_e8m0(sc);
      } else {
        *reinterpret_cast<uint32_t*>(data + 448 + 2 * (gch - 448 + 2 * lane)) =
            num::pack_bf16(v0, v1);
        if (lane == 0) scales[7] = 0;
      }
    }
  }
  __syncthreads();  // smem is reused by the next block
}

// The outgoing state for this CTA's columns (see the header comment).
template <class Cfg>
__device__ __forceinline__ void update_state(const CompressorParams& p, const SeqInfo& si,
                                             int rank) {
  constexpr int kTile = Cfg::kTile, kQ = kTile / 4;
  const int c0 = rank * kTile;
  const int e = si.p0 + si.n - 1;  // last position of the chunk
  float* kv_rows = si.state;
  float* sc_rows = si.state + int64_t(Cfg::kRows) * Cfg::kWidth;
  auto chunk_row = [&](int pos, int col, float4& kv, float4& sc) {
    const int64_t r = si.row0 + (pos - si.p0);
    kv = ld4(p.a + r * p.a_stride + col);
    sc = add4(ld4(p.g + r * p.g_stride + col),
              ld4(p.ape + int64_t(pos % Cfg::kRatio) * Cfg::kWidth + col));
  };
  if constexpr (Cfg::kRatio == 4) {
    const bool completed = (si.p0 + si.n) / 4 > si.p0 / 4;
    const int last_block = (si.p0 + si.n) / 4 - 1;
    // Row pair (j, 4+j) x column quads of both halves.
    for (int task = threadIdx.x; task < 4 * 2 * kQ; task += Cfg::kThreads) {
      const int j = task / (2 * kQ), qq = task % (2 * kQ);
      const int col = qq < kQ ? c0 + 4 * qq : Cfg::kDim + c0 + 4 * (qq - kQ);
      const int pc = e - (((e - j) % 4) + 4) % 4;  // last chunk position with residue j
      float4 pk, ps, ck, cs;
      if (completed) {
        const int pp = 4 * last_block + j;
        if (pp >= si.p0) {
          chunk_row(pp, col, pk, ps);
        } else {
          pk = *reinterpret_cast<const float4*>(kv_rows + (4 + j) * Cfg::kWidth + col);
          ps = *reinterpret_cast<const float4*>(sc_rows + (4 + j) * Cfg::kWidth + col);
        }
      }
      if (pc >= si.p0) chunk_row(pc, col, ck, cs);
      if (completed) {
        st4(kv_rows + j * Cfg::kWidth + col, pk);
        st4(sc_rows + j * Cfg::kWidth + col, ps);
      }
      if (pc >= si.p0) {
        st4(kv_rows + (4 + j) * Cfg::kWidth + col, ck);
        st4(sc_rows + (4 + j) * Cfg::kWidth + col, cs);
      }
    }
  } else {
    for (int task = threadIdx.x; task < Cfg::kRows * kQ; task += Cfg::kThreads) {
      const int j = task / kQ, col = c0 + 4 * (task % kQ);
      const int pc = e - (((e - j) % Cfg::kRatio) + Cfg::kRatio) % Cfg::kRatio;
      if (pc < si.p0) continue;
      float4 ck, cs;
      chunk_row(pc, col, ck, cs);
      st4(kv_rows + j * Cfg::kWidth + col, ck);
      st4(sc_rows + j * Cfg::kWidth + col, cs);
    }
  }
}

// A cluster per sequence: pool every block completing in the chunk (kPool), then update the
// state of this CTA's columns.
template <class Cfg, bool kPool>
__global__ void __launch_bounds__(Cfg::kThreads, 1) compressor_seq_kernel(CompressorParams p) {
  extern __shared__ __align__(16) float smem[];
  __shared__ double red[Cfg::kWarps];
  __shared__ double part;
  // Launched programmatically (p.pdl): nothing is read before the kernel before is complete.
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int s = blockIdx.x / Cfg::kCluster, rank = blockIdx.x % Cfg::kCluster;
  const SeqInfo si = seq_info<Cfg>(p, s);
  if constexpr (kPool) {
    const Smem<Cfg> sm(smem);
    const int nb = blocks_completing<Cfg>(si.p0, si.n);
    for (int k = 0; k < nb; ++k)
      pool_block<Cfg>(p, s, si, si.p0 / Cfg::kRatio + k, rank, sm, red, &part);
    __syncthreads();
  }
  update_state<Cfg>(p, si, rank);
}

// Finds the sequence and block of completing block `w` of the batch (blocks numbered
// sequence by sequence): {s, k}, or s = -1 when w is past the last one. Uniform over the CTA.
template <class Cfg>
__device__ __forceinline__ int2 find_block(const CompressorParams& p, int w) {
  __shared__ int warp_tot[Cfg::kWarps];
  __shared__ int found_s, found_k;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) found_s = -1;
  int rem = w;
  for (int base = 0; base < p.num_seqs; base += Cfg::kThreads) {
    const int s = base + tid;
    int cnt = 0;
    if (s < p.num_seqs) {
      const int r0 = p.cu_seqlens[s];
      cnt = blocks_completing<Cfg>(p.start_pos[s], p.cu_seqlens[s + 1] - r0);
    }
    int incl = cnt;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    __syncthreads();
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    int total = 0;
    for (int q = 0; q < Cfg::kWarps; ++q) {
      if (q < warp) incl += warp_tot[q];
      total += warp_tot[q];
    }
    if (rem < total) {
      if (cnt > 0 && rem >= incl - cnt && rem < incl) {
        found_s = s;
        found_k = rem - (incl - cnt);
      }
      __syncthreads();
      return make_int2(found_s, found_k);
    }
    rem -= total;
  }
  return make_int2(-1, 0);
}

// A cluster per completing block of the batch (split path).
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) compressor_pool_kernel(CompressorParams p) {
  extern __shared__ __align__(16) float smem[];
  __shared__ double red[Cfg::kWarps];
  __shared__ double part;
  sm90::griddep_wait();  // as compressor_seq_kernel
  sm90::griddep_launch_dependents();
  const int w = blockIdx.x / Cfg::kCluster, rank = blockIdx.x % Cfg::kCluster;
  const int2 sk = find_block<Cfg>(p, w);
  if (sk.x < 0) return;  // the whole cluster agrees
  const int s = sk.x, k = sk.y;
  const SeqInfo si = seq_info<Cfg>(p, s);
  pool_block<Cfg>(p, s, si, si.p0 / Cfg::kRatio + k, rank, Smem<Cfg>(smem), red, &part);
}

void launch(void (*kernel)(CompressorParams), int ctas, int cluster, int threads, int smem,
            cudaStream_t stream, const CompressorParams& p, bool pdl) {
  if (ctas == 0) return;
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  LaunchConfig c{dim3(unsigned(ctas)), dim3(unsigned(threads)), size_t(smem), stream, pdl};
  c.cluster = dim3(unsigned(cluster), 1, 1);
  launch_kernel(c, kernel, p);
}

template <int kRatio, int kDim>
void run(const CompressorParams& p, cudaStream_t stream) {
  using Cfg = CompressorConfig<kRatio, kDim>;
  const bool fused = p.path == CompressorPath::kFused ||
                     (p.path == CompressorPath::kAuto && p.max_seq_tokens <= kRatio);
  const int seq_ctas = p.num_seqs * Cfg::kCluster;
  if (fused) {
    launch(compressor_seq_kernel<Cfg, true>, seq_ctas, Cfg::kCluster, Cfg::kThreads,
           Cfg::kSmemBytes, stream, p, p.pdl);
    return;
  }
  // At most ceil(n_s / ratio) <= n_s / ratio + 1 blocks complete per sequence.
  const int64_t bound = int64_t(p.num_tokens) / kRatio + p.num_seqs;
  DSV4_CHECK(bound * Cfg::kCluster < (int64_t(1) << 31), "compressor_forward: batch too large");
  launch(compressor_pool_kernel<Cfg>, int(bound) * Cfg::kCluster, Cfg::kCluster, Cfg::kThreads,
         Cfg::kSmemBytes, stream, p, p.pdl);
  // State update only: no shared memory, no cluster (CTA r of a sequence still owns tile r).
  launch(compressor_seq_kernel<Cfg, false>, seq_ctas, 1, Cfg::kThreads, 0, stream, p, true);
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % 16) == 0;
}

__global__ void reset_states_kernel(float* states, const int32_t* __restrict__ slots,
                                    int64_t floats, int64_t kv_floats) {
  float* st = states + int64_t(slots[blockIdx.y]) * floats;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < floats;
       i += int64_t(gridDim.x) * blockDim.x)
    st[i] = i < kv_floats ? 0.0f : -__uint_as_float(0x7f800000u);
}

}  // namespace

void compressor_reset_states(float* states, const int32_t* slots, int num_slots, int ratio, int dim,
                             cudaStream_t stream) {
  DSV4_CHECK((ratio == 4 || ratio == 128) && dim > 0 && num_slots >= 0,
             "compressor_reset_states: ratio ", ratio, ", d ", dim, ", slots ", num_slots);
  if (num_slots == 0) return;
  DSV4_CHECK(states && slots, "compressor_reset_states: null pointer");
  DSV4_CHECK(num_slots <= 65535, "compressor_reset_states: too many slots at once");
  const CompressorStateLayout l{ratio, dim};
  reset_states_kernel<<<dim3(32, num_slots), 256, 0, stream>>>(states, slots, l.floats(),
                                                               l.score_offset(0));
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void compressor_forward(const CompressorParams& p, cudaStream_t stream) {
  const char* fn = "compressor_forward";
  const bool main4 = p.ratio == 4 && p.dim == 512 && !p.indexer;
  const bool index4 = p.ratio == 4 && p.dim == 128 && p.indexer;
  const bool main128 = p.ratio == 128 && p.dim == 512 && !p.indexer;
  DSV4_CHECK(main4 || index4 || main128, fn, ": unsupported compressor (ratio ", p.ratio, ", d ",
             p.dim, ", indexer ", p.indexer,
             "); supported: ratio 4 d 512, ratio 4 d 128 indexer, ratio 128 d 512");
  DSV4_CHECK(p.num_seqs >= 0 && p.num_tokens >= 0 && p.max_seq_tokens >= 0, fn, ": negative sizes");
  if (p.num_seqs == 0) return;
  DSV4_CHECK(p.cu_seqlens && p.start_pos && p.state_slot && p.states, fn,
             ": batch arrays / states missing");
  DSV4_CHECK(p.ape && p.norm_weight && p.inv_freq, fn, ": ape / norm_weight / inv_freq missing");
  DSV4_CHECK(aligned16(p.states) && aligned16(p.ape), fn, ": states / ape must be 16-byte aligned");
  const int width = (p.ratio == 4 ? 2 : 1) * p.dim;
  if (p.num_tokens > 0) {
    DSV4_CHECK(p.a && p.g && aligned16(p.a) && aligned16(p.g), fn,
               ": a / g must be 16-byte aligned pointers");
    DSV4_CHECK(
        p.a_stride >= width && p.g_stride >= width && p.a_stride % 4 == 0 && p.g_stride % 4 == 0,
        fn, ": a/g row strides (", p.a_stride, ", ", p.g_stride, ") must be >= coff*d = ", width,
        " and multiples of 4");
  }
  const PagedStoreView& v = p.store;
  const int want_data = p.indexer ? IndexKeyLayout{}.data_bytes() : KvEntryLayout{}.data_bytes();
  const int want_scales =
      p.indexer ? IndexKeyLayout{}.scale_bytes() : KvEntryLayout{}.scale_bytes();
  DSV4_CHECK(v.pages && v.block_table && v.stride > 0 && v.page_size > 0, fn,
             ": store (pages, block table, stride, page_size) missing");
  DSV4_CHECK(v.data_bytes == want_data && v.scale_bytes == want_scales, fn, ": store holds ",
             v.data_bytes, "+", v.scale_bytes, "-byte entries, expected ", want_data, "+",
             want_scales);
  DSV4_CHECK(v.page_bytes >= int64_t(v.page_size) * (want_data + want_scales) &&
                 v.page_bytes % 16 == 0 && aligned16(v.pages),
             fn, ": bad page geometry");
  if (main4)
    run<4, 512>(p, stream);
  else if (index4)
    run<4, 128>(p, stream);
  else
    run<128, 512>(p, stream);
}

}  // namespace dsv4::cuda
