// Attention front-end kernels: RoPE table, q per-head RMS + RoPE, window-KV entry encoding
// and insertion. Bit-exact with the CPU reference's rounding points (see
// ops/cuda/common/numerics.cuh).
#include "ops/cuda/attn_frontend/attn_frontend.h"

#include <cstdint>

#include "core/error.h"
#include "ops/cuda/attn_frontend/attn_frontend_config.h"
#include "ops/cuda/attn_frontend/kv_entry.cuh"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/numerics.cuh"
#include "ops/cuda/common/sm90/sync.cuh"

namespace dsv4::cuda {
namespace {

using namespace attn_frontend_cfg;

bool aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// A launch, with programmatic dependent launch when `pdl` (the kernel waits in
// griddepcontrol.wait before it reads what the kernel before wrote).
template <class Params>
void launch(void (*kernel)(Params), dim3 grid, dim3 block, bool pdl, cudaStream_t stream,
            const Params& p) {
  LaunchConfig cfg;
  cfg.grid = grid;
  cfg.block = block;
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel(cfg, kernel, p);
}

__global__ void __launch_bounds__(kRopeThreads)
    rope_table_kernel(const int32_t* __restrict__ positions, const float* __restrict__ inv_freq,
                      int num_tokens, float2* __restrict__ out) {
  const int64_t idx = int64_t(blockIdx.x) * kRopeThreads + threadIdx.x;
  if (idx >= int64_t(num_tokens) * kRopePairs) return;
  const int t = int(idx / kRopePairs), i = int(idx % kRopePairs);
  out[idx] = num::rope_cos_sin(positions[t], inv_freq[i]);
}

// Token t's heads [head_group * kQHeadsPerCta, +kQHeadsPerCta) by the CTA's kQWarps warps: one
// warp per head row, kQRowsPerWarp rows per warp loaded together.
__device__ __forceinline__ void q_norm_rope_heads(const QNormRopeParams& p, int t, int head_group) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h0 = head_group * kQHeadsPerCta + warp * kQRowsPerWarp;
  const size_t tok = size_t(t) * p.num_heads;
  uint4 v[kQRowsPerWarp][2];
#pragma unroll
  for (int r = 0; r < kQRowsPerWarp; ++r) {
    if (h0 + r < p.num_heads) {
      const uint4* row = reinterpret_cast<const uint4*>(p.q + (tok + h0 + r) * kHeadDim);
      v[r][0] = __ldg(row + lane);
      v[r][1] = __ldg(row + 32 + lane);
    }
  }
  float2 cs[4];
  if (lane >= 24) {
#pragma unroll
    for (int j = 0; j < 4; ++j) cs[j] = p.cos_sin[size_t(t) * kRopePairs + 4 * (lane - 24) + j];
  }
#pragma unroll
  for (int r = 0; r < kQRowsPerWarp; ++r) {
    if (h0 + r >= p.num_heads) break;  // warp-uniform
    float x0[8], x1[8];
    num::unpack8(v[r][0], x0);
    num::unpack8(v[r][1], x1);
    // cpu::rms_norm_bf16_weightless: every intermediate rounded to BF16; the squares are
    // summed in double (exact for BF16 squares, so the order does not matter).
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      s = __dadd_rn(s, double(num::bf16r(__fmul_rn(x0[i], x0[i]))));
      s = __dadd_rn(s, double(num::bf16r(__fmul_rn(x1[i], x1[i]))));
    }
    s = num::warp_sum_d(s);
    const float mean = num::bf16r(float(__ddiv_rn(s, double(kHeadDim))));
    const float tt = num::bf16r(__fadd_rn(mean, p.eps));
    const float rs = num::bf16r(__fdiv_rn(1.0f, __fsqrt_rn(tt)));
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x0[i] = num::bf16r(__fmul_rn(x0[i], rs));
      x1[i] = num::bf16r(__fmul_rn(x1[i], rs));
    }
    if (lane >= 24) {
#pragma unroll
      for (int j = 0; j < 4; ++j) num::rope_pair(x1[2 * j], x1[2 * j + 1], cs[j], false);
    }
    uint4* out = reinterpret_cast<uint4*>(p.out + (tok + h0 + r) * kHeadDim);
    out[lane] = num::pack8(x0);
    out[32 + lane] = num::pack8(x1);
  }
}

__global__ void __launch_bounds__(kQWarps * 32) q_norm_rope_kernel(QNormRopeParams p) {
  // Launched programmatically (p.pdl): q is read once the kernel before is complete; the next
  // kernel may launch at once (it waits for this grid's completion in turn).
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  q_norm_rope_heads(p, blockIdx.x, blockIdx.y);
}

// The lane's 16 kv_norm weights (dims 8 lane .. +7 and 256 + 8 lane .. +7).
__device__ __forceinline__ void load_kv_norm_weight(const KvInsertParams& p, int lane,
                                                    uint4 (&w)[2]) {
  const uint4* wrow = reinterpret_cast<const uint4*>(p.norm_weight);
  w[0] = __ldg(wrow + lane);
  w[1] = __ldg(wrow + 32 + lane);
}

// Token t's window-KV entry by the calling warp; `wn`: the lane's kv_norm weights
// (load_kv_norm_weight; kNormRope only).
template <bool kNormRope>
__device__ __forceinline__ void kv_entry_row(const KvInsertParams& p, int t, int lane,
                                             const uint4 (&wn)[2]) {
  const uint4* row = reinterpret_cast<const uint4*>(p.kv + size_t(t) * kHeadDim);
  float x0[8], x1[8];
  num::unpack8(__ldg(row + lane), x0);
  num::unpack8(__ldg(row + 32 + lane), x1);
  if constexpr (kNormRope) {
    float w0[8], w1[8];
    num::unpack8(wn[0], w0);
    num::unpack8(wn[1], w1);
    float2 cs[4];
    if (lane >= 24) {
#pragma unroll
      for (int j = 0; j < 4; ++j) cs[j] = p.cos_sin[size_t(t) * kRopePairs + 4 * (lane - 24) + j];
    }
    kv_norm_rope_row(x0, x1, w0, w1, cs, p.eps, lane);
  }
  KvEntryRegs e = encode_kv_row(x0, x1, lane);
  if (p.cache.pages != nullptr) {
    const int s = p.token_seq[t];
    if (s >= 0) {
      const int slot = p.positions[t] % p.window;
      store_kv_entry(e, entry_data(p.cache, s, slot), entry_scales(p.cache, s, slot), lane);
    }
  }
  if (p.staged != nullptr) {
    uint8_t* d = p.staged + size_t(t) * kKvEntryBytes;
    store_kv_entry_packed(e, d, lane);
  }
  if (p.decoded != nullptr) {
    uint4* d = reinterpret_cast<uint4*>(p.decoded + size_t(t) * kHeadDim);
    float y0[8], y1[8];
    decode_kv_row(e, x1, y0, y1, lane);
    d[lane] = num::pack8(y0);
    d[32 + lane] = num::pack8(y1);
  }
}

template <bool kNormRope>
__global__ void __launch_bounds__(kKvWarps * 32) kv_entry_kernel(KvInsertParams p) {
  sm90::griddep_wait();  // as q_norm_rope_kernel
  sm90::griddep_launch_dependents();
  const int t = blockIdx.x * kKvWarps + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;
  uint4 wn[2] = {};
  if constexpr (kNormRope) load_kv_norm_weight(p, threadIdx.x & 31, wn);
  kv_entry_row<kNormRope>(p, t, threadIdx.x & 31, wn);
}

// Both front-end steps of the decode path in one grid (T, head groups + 1): rows y < head
// groups are q_norm_rope's CTAs; row y == head groups holds the window-KV entries, one token
// per warp (CTA x: tokens [kQWarps x, kQWarps x + kQWarps)).
__global__ void __launch_bounds__(kQWarps * 32)
    q_norm_rope_kv_kernel(QNormRopeParams q, KvInsertParams kv) {
  // The kv_norm weight is no kernel's output: loaded before the wait (after it, it queued
  // behind the weight prefetch of the streaming launch this kernel lets start).
  const bool kv_cta = blockIdx.y == gridDim.y - 1;
  uint4 wn[2] = {};
  if (kv_cta) load_kv_norm_weight(kv, threadIdx.x & 31, wn);
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  if (!kv_cta) {
    q_norm_rope_heads(q, blockIdx.x, blockIdx.y);
    return;
  }
  const int t = blockIdx.x * kQWarps + (threadIdx.x >> 5);
  if (t < kv.num_tokens) kv_entry_row<true>(kv, t, threadIdx.x & 31, wn);
}

__global__ void __launch_bounds__(kKvWarps * 32) kv_insert_staged_kernel(KvInsertStagedParams p) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * kKvWarps + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;
  const int s = p.token_seq[t];
  if (s < 0) return;
  const int slot = p.positions[t] % p.window;
  const uint2* src = reinterpret_cast<const uint2*>(p.staged + size_t(t) * kKvEntryBytes);
  uint2* data = reinterpret_cast<uint2*>(entry_data(p.cache, s, slot));
  // 72 data words then 1 scale word.
  for (int i = lane; i < kKvDataBytes / 8; i += 32) data[i] = src[i];
  if (lane == 0) *reinterpret_cast<uint2*>(entry_scales(p.cache, s, slot)) = src[kKvDataBytes / 8];
}

void check_kv_store(const PagedStoreView& v, int window, const int32_t* token_seq,
                    const int32_t* positions, const char* fn) {
  DSV4_CHECK(v.data_bytes == kKvDataBytes && v.scale_bytes == kKvScaleBytes, fn,
             ": cache is not a 584-byte KV store (data ", v.data_bytes, ", scales ", v.scale_bytes,
             ")");
  DSV4_CHECK(v.page_size > 0 && v.page_bytes >= int64_t(v.page_size) * kKvEntryBytes &&
                 v.page_bytes % 16 == 0,
             fn, ": bad page geometry (page_size ", v.page_size, ", page_bytes ", v.page_bytes,
             ")");
  DSV4_CHECK(v.block_table != nullptr && v.stride > 0, fn, ": cache needs a block table");
  DSV4_CHECK(window > 0 && int64_t(window) <= int64_t(v.stride) * v.page_size, fn, ": window ",
             window, " does not fit a block-table row of ", v.stride, " pages x ", v.page_size);
  DSV4_CHECK(token_seq != nullptr && positions != nullptr, fn,
             ": inserting needs token_seq and positions");
  DSV4_CHECK(aligned(v.pages, 16), fn, ": cache pages must be 16-byte aligned");
}

void check_kv_params(const KvInsertParams& p, bool norm_rope, const char* fn) {
  DSV4_CHECK(p.num_tokens >= 0, fn, ": num_tokens ", p.num_tokens);
  if (p.num_tokens == 0) return;
  DSV4_CHECK(p.kv != nullptr && aligned(p.kv, 16), fn, ": kv must be a 16-byte aligned pointer");
  if (norm_rope) {
    DSV4_CHECK(p.norm_weight != nullptr && aligned(p.norm_weight, 16), fn,
               ": norm_weight must be a 16-byte aligned pointer");
    DSV4_CHECK(p.cos_sin != nullptr, fn, ": cos_sin missing");
  }
  DSV4_CHECK(p.cache.pages != nullptr || p.staged != nullptr || p.decoded != nullptr, fn,
             ": no output (cache, staged, decoded all null)");
  if (p.cache.pages != nullptr) check_kv_store(p.cache, p.window, p.token_seq, p.positions, fn);
  DSV4_CHECK(p.staged == nullptr || aligned(p.staged, 8), fn, ": staged must be 8-byte aligned");
  DSV4_CHECK(p.decoded == nullptr || aligned(p.decoded, 16), fn,
             ": decoded must be 16-byte aligned");
}

// q_norm_rope's arguments; its grid (tokens, head groups), `extra_rows` more rows of CTAs
// allowed for (the fused front end's KV row).
dim3 check_q_params(const QNormRopeParams& p, int extra_rows, const char* fn) {
  DSV4_CHECK(p.num_tokens >= 0 && p.num_heads > 0, fn, ": tokens ", p.num_tokens, ", heads ",
             p.num_heads);
  const dim3 grid(p.num_tokens, (p.num_heads + kQHeadsPerCta - 1) / kQHeadsPerCta);
  if (p.num_tokens == 0) return grid;
  DSV4_CHECK(p.q && p.out && p.cos_sin, fn, ": null pointer");
  DSV4_CHECK(aligned(p.q, 16) && aligned(p.out, 16), fn, ": q/out must be 16-byte aligned");
  DSV4_CHECK(grid.y + extra_rows <= 65535, fn, ": too many heads (", p.num_heads, ")");
  return grid;
}

}  // namespace

void rope_cos_sin(const RopeTableParams& p, cudaStream_t stream) {
  DSV4_CHECK(p.num_tokens >= 0, "rope_cos_sin: num_tokens ", p.num_tokens);
  if (p.num_tokens == 0) return;
  DSV4_CHECK(p.positions && p.inv_freq && p.cos_sin, "rope_cos_sin: null pointer");
  const int64_t n = int64_t(p.num_tokens) * kRopePairs;
  rope_table_kernel<<<unsigned((n + kRopeThreads - 1) / kRopeThreads), kRopeThreads, 0, stream>>>(
      p.positions, p.inv_freq, p.num_tokens, p.cos_sin);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

void q_norm_rope(const QNormRopeParams& p, cudaStream_t stream) {
  const dim3 grid = check_q_params(p, 0, "q_norm_rope");
  if (p.num_tokens == 0) return;
  launch(q_norm_rope_kernel, grid, dim3(kQWarps * 32), p.pdl, stream, p);
}

void q_norm_rope_kv_insert(const QNormRopeParams& q, const KvInsertParams& kv,
                           cudaStream_t stream) {
  dim3 grid = check_q_params(q, 1, "q_norm_rope_kv_insert");
  check_kv_params(kv, true, "q_norm_rope_kv_insert");
  DSV4_CHECK(q.num_tokens == kv.num_tokens, "q_norm_rope_kv_insert: ", q.num_tokens,
             " query tokens but ", kv.num_tokens, " KV tokens");
  DSV4_CHECK(q.pdl == kv.pdl, "q_norm_rope_kv_insert: one launch, one pdl setting");
  if (q.num_tokens == 0) return;
  grid.y += 1;  // the KV row
  launch_kernel(LaunchConfig{grid, dim3(kQWarps * 32), 0, stream, q.pdl}, q_norm_rope_kv_kernel, q,
                kv);
}

void kv_norm_rope_insert(const KvInsertParams& p, cudaStream_t stream) {
  check_kv_params(p, true, "kv_norm_rope_insert");
  if (p.num_tokens == 0) return;
  launch(kv_entry_kernel<true>, dim3((p.num_tokens + kKvWarps - 1) / kKvWarps), dim3(kKvWarps * 32),
         p.pdl, stream, p);
}

void kv_quant_insert(const KvInsertParams& p, cudaStream_t stream) {
  check_kv_params(p, false, "kv_quant_insert");
  if (p.num_tokens == 0) return;
  launch(kv_entry_kernel<false>, dim3((p.num_tokens + kKvWarps - 1) / kKvWarps),
         dim3(kKvWarps * 32), p.pdl, stream, p);
}

void kv_insert_staged(const KvInsertStagedParams& p, cudaStream_t stream) {
  DSV4_CHECK(p.num_tokens >= 0, "kv_insert_staged: num_tokens ", p.num_tokens);
  if (p.num_tokens == 0) return;
  DSV4_CHECK(p.staged != nullptr && aligned(p.staged, 8),
             "kv_insert_staged: staged must be an 8-byte aligned pointer");
  DSV4_CHECK(p.cache.pages != nullptr, "kv_insert_staged: cache missing");
  check_kv_store(p.cache, p.window, p.token_seq, p.positions, "kv_insert_staged");
  kv_insert_staged_kernel<<<(p.num_tokens + kKvWarps - 1) / kKvWarps, kKvWarps * 32, 0, stream>>>(
      p);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsv4::cuda
