// What the two indexer-logits kernels (indexer_logits.cu: mma.sync; indexer_logits_wgmma.cu:
// warpgroup MMA) share: their arguments, their grid — (key chunks, token tiles of
// kMaxTokensPerCta tokens of one sequence, sequences) — and a CTA's share of it, the MMA width
// for a head count; and the launcher of the wgmma kernel (indexer_logits.cu dispatches).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/cuda/common/paged_cache.h"
#include "ops/cuda/indexer/indexer.h"
#include "ops/cuda/indexer/indexer_config.h"

namespace dsv4::cuda::indexer_detail {

struct LogitsArgs {
  const __nv_bfloat16* q_fp4;
  const __nv_bfloat16* weights;
  __nv_bfloat16* scores;
  int64_t stride;
  const int32_t* cu_seqlens;
  const int32_t* seq_pos0;
  PagedStoreView keys;
  int ratio;
  int keys_per_cta;
  int heads;  // the real head count (<= the kernel's MMA width); q_fp4 / weights rows hold this
              // many
  int cta_tokens = 0;           // query tokens a CTA's shared memory holds (wgmma kernel's layout)
  bool keys_read_once = false;  // one CTA of tokens a sequence: L2 evict-first for the keys
};

// The grid of a launch and the keys a CTA covers: about `ctas_per_sm` CTAs a streaming
// multiprocessor, each covering a multiple of `tile_keys` keys, at most `max_keys`. Throws when
// the batch exceeds the grid's limits.
struct LogitsGrid {
  dim3 grid;
  int keys_per_cta = 0;
  int token_tiles = 0;  // grid.y
};
LogitsGrid logits_grid(const IndexerParams& p, int tile_keys, int max_keys, int ctas_per_sm);

// `p`'s arguments for a grid (cta_tokens / keys_read_once left to the wgmma launcher).
LogitsArgs logits_args(const IndexerParams& p, const LogitsGrid& g);

// Calls f(std::integral_constant<int, HI>{}) with the MMA width for `n_heads`: the head count
// rounded up to 8, 16, 32 or 64 (the missing heads run with zero queries and weights).
template <typename F>
void with_head_width(int n_heads, F&& f) {
  if (n_heads <= 8)
    f(std::integral_constant<int, 8>{});
  else if (n_heads <= 16)
    f(std::integral_constant<int, 16>{});
  else if (n_heads <= 32)
    f(std::integral_constant<int, 32>{});
  else
    f(std::integral_constant<int, 64>{});
}

// The warpgroup-MMA logits kernel (IndexerLogitsPath::kWgmma).
void launch_logits_wgmma(const IndexerParams& p, cudaStream_t stream);

#if defined(__CUDACC__)
// A CTA's share of the grid: sequence s, its tokens [t0, t0 + nt) at positions p_first.., and
// the keys [k_begin, k_end) of the chunk that its last token sees.
struct LogitsCta {
  int s, t0, nt, p_first, k_begin, k_end;
};
// false: the CTA has no tokens or no visible keys.
__device__ __forceinline__ bool logits_cta(const LogitsArgs& a, LogitsCta& c) {
  c.s = blockIdx.z;
  const int seq_t0 = __ldg(a.cu_seqlens + c.s);
  const int seq_n = __ldg(a.cu_seqlens + c.s + 1) - seq_t0;
  const int tile0 = blockIdx.y * indexer_cfg::kMaxTokensPerCta;
  if (tile0 >= seq_n) return false;
  c.nt = min(indexer_cfg::kMaxTokensPerCta, seq_n - tile0);
  c.t0 = seq_t0 + tile0;
  c.p_first = __ldg(a.seq_pos0 + c.s) + tile0;
  c.k_begin = blockIdx.x * a.keys_per_cta;
  c.k_end = min(c.k_begin + a.keys_per_cta, (c.p_first + c.nt) / a.ratio);
  return c.k_begin < c.k_end;
}
#endif

}  // namespace dsv4::cuda::indexer_detail
