// Indexer logits: BF16 tensor-core dot products of the FP4-faked queries with the MXFP4 keys
// read straight from the paged cache, and the reference's epilogue
//   score = bf16( sum_h bf16( relu(bf16(q_h . k)) * w_h ) ).
//
// MMA orientation: M = keys (16 per tile), N = heads, K = the 128 key dims, so the head sum
// stays inside a quad of lanes. The keys are decoded once per CTA into registers (A
// fragments) and reused for up to 4 query tokens. Each lane loads 16 bytes (one 32-value
// scale block) of a key, so the fragment's k order is a fixed permutation of the key dims;
// the queries are staged in smem in the same permuted order, which leaves every dot product
// unchanged. A key's block scales are applied relative to its largest one (exact powers of
// two in BF16); that largest power of two multiplies the fp32 head sum, which is exactly the
// reference's result because scaling by 2^e commutes with each BF16 rounding.
// Head counts below the MMA width HI (not 8, 16, 32 or 64) run at the next one up with the
// missing heads' queries and weights zero in smem: each adds relu(bf16(0)) * 0 = +0 to the
// fp32 head sum, which leaves it unchanged, so the score is the one of the real heads.
#include <cuda_bf16.h>

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/common/sm90/bf16x2.cuh"
#include "ops/cuda/common/sm90/cp_async.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/common/sm90/warp_mma.cuh"
#include "ops/cuda/indexer/indexer.h"
#include "ops/cuda/indexer/indexer_config.h"
#include "ops/cuda/indexer/indexer_internal.h"
#include "ops/cuda/indexer/indexer_logits_args.h"
#include "ops/cuda/sparse_attention/decode.cuh"

namespace dsv4::cuda {
namespace {

using namespace indexer_cfg;
using namespace detail;
using indexer_detail::LogitsArgs;

template <int HI>
struct LogitsSmem {
  static constexpr int kQRow = kHeadDim + kQRowPad;
  __nv_bfloat16 q[kMaxTokensPerCta][HI][kQRow];
  __nv_bfloat16 w[kMaxTokensPerCta][HI];
  alignas(16) uint8_t kd[kStages][kTileKeys][kKeyBytes];
  uint32_t ks[kStages][kTileKeys];
};

// Logical k index (step s, column l of the fragment) -> physical key dim, pairs-wise: the u32
// (pair) index of the dims of fragment pair (s, half) for lane quad position c.
__device__ __forceinline__ int phys_pair(int s, int half, int c) {
  return 16 * c + 4 * (s >> 1) + 2 * (s & 1) + half;
}

template <int HI>
__global__ void __launch_bounds__(kLogitsThreads, 2) indexer_logits_kernel(const LogitsArgs a) {
  constexpr int NT = HI / 8;  // n8 tiles of heads
  extern __shared__ __align__(16) uint8_t smem_raw[];
  LogitsSmem<HI>& sm = *reinterpret_cast<LogitsSmem<HI>*>(smem_raw);
  // Launched programmatically (IndexerParams::pdl): nothing is read before the kernel before
  // is complete.
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();

  indexer_detail::LogitsCta cta;
  if (!indexer_detail::logits_cta(a, cta)) return;
  const int s = cta.s, nt = cta.nt, t0 = cta.t0, p_first = cta.p_first;
  const int k_begin = cta.k_begin, k_end = cta.k_end;
  const int ntiles = (k_end - k_begin + kTileKeys - 1) / kTileKeys;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;

  // Key tile loader: thread i fetches key k0 + i (64 data bytes + 4 scale bytes).
  auto load_tile = [&](int it, int stage) {
    const int key = k_begin + it * kTileKeys + tid;
    uint8_t* dst = sm.kd[stage][tid];
    if (key < k_end) {
      const uint8_t* src = entry_data(a.keys, s, key);
#pragma unroll
      for (int j = 0; j < kKeyBytes / 16; ++j) sm90::cp_async_16(dst + 16 * j, src + 16 * j);
      sm90::cp_async_4(&sm.ks[stage][tid], entry_scales(a.keys, s, key));
    } else {
#pragma unroll
      for (int j = 0; j < kKeyBytes / 16; ++j)
        *reinterpret_cast<uint4*>(dst + 16 * j) = make_uint4(0, 0, 0, 0);
      sm.ks[stage][tid] = 0;
    }
  };
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < ntiles) load_tile(st, st);
    sm90::cp_async_commit();
  }

  // Queries in the fragment's permuted k order, and the head weights.
  {
    const uint32_t* qg = reinterpret_cast<const uint32_t*>(a.q_fp4);
    const int H = a.heads;
    const int chunks = nt * HI * 16;  // 16-byte chunks: (token, head, step, half)
    for (int i = tid; i < chunks; i += kLogitsThreads) {
      const int half = i & 1, st = (i >> 1) & 7, h = (i >> 4) % HI, tq = (i >> 4) / HI;
      uint4 v = make_uint4(0, 0, 0, 0);  // padding heads: zero queries
      if (h < H) {
        const uint32_t* row = qg + (size_t(t0 + tq) * H + h) * (kHeadDim / 2);
        v.x = __ldg(row + phys_pair(st, half, 0));
        v.y = __ldg(row + phys_pair(st, half, 1));
        v.z = __ldg(row + phys_pair(st, half, 2));
        v.w = __ldg(row + phys_pair(st, half, 3));
      }
      *reinterpret_cast<uint4*>(&sm.q[tq][h][16 * st + 8 * half]) = v;
    }
    for (int i = tid; i < nt * HI; i += kLogitsThreads) {
      const int tq = i / HI, h = i % HI;
      sm.w[tq][h] = h < H ? a.weights[size_t(t0 + tq) * H + h] : __float2bfloat16_rn(0.0f);
    }
  }

#pragma unroll 1
  for (int it = 0; it < ntiles; ++it) {
    sm90::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (it + kStages - 1 < ntiles) load_tile(it + kStages - 1, (it + kStages - 1) % kStages);
    sm90::cp_async_commit();
    const int stage = it % kStages;
    const int kb = k_begin + it * kTileKeys;

    // Decode this warp's 32 keys into A fragments: rows g, g+8 of two m16 tiles.
    uint32_t A[2][8][4];
    float kscale[2][2];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp * kKeysPerWarp + 16 * m + 8 * r + g;
        const uint4 d = *reinterpret_cast<const uint4*>(&sm.kd[stage][row][16 * c]);
        const uint32_t sc = sm.ks[stage][row];
        const int e0 = sc & 0xff, e1 = (sc >> 8) & 0xff, e2 = (sc >> 16) & 0xff, e3 = sc >> 24;
        const int emax = max(max(e0, e1), max(e2, e3));
        const int ec = (sc >> (8 * c)) & 0xff;
        const uint32_t scale2 = bf16x2_pow2(ec - emax);
        kscale[m][r] = e8m0_to_float(uint32_t(emax));
        const uint32_t words[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
        for (int wd = 0; wd < 4; ++wd) {
          uint32_t o[4];
          e2m1x8_to_bf16x8(words[wd], scale2, o);
          A[m][2 * wd][r] = o[0];
          A[m][2 * wd][2 + r] = o[1];
          A[m][2 * wd + 1][r] = o[2];
          A[m][2 * wd + 1][2 + r] = o[3];
        }
      }
    }

#pragma unroll 1
    for (int tq = 0; tq < nt; ++tq) {
      float acc[2][NT][4];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.0f;
#pragma unroll
      for (int st = 0; st < 8; ++st) {
        if constexpr (NT >= 2) {
#pragma unroll
          for (int jp = 0; jp < NT / 2; ++jp) {
            uint32_t b0, b1, b2, b3;
            sm90::ldmatrix_x4(
                b0, b1, b2, b3,
                &sm.q[tq][16 * jp + 8 * (lane >> 4) + (lane & 7)][16 * st + 8 * ((lane >> 3) & 1)]);
            sm90::mma_bf16_16816(acc[0][2 * jp], A[0][st], b0, b1);
            sm90::mma_bf16_16816(acc[0][2 * jp + 1], A[0][st], b2, b3);
            sm90::mma_bf16_16816(acc[1][2 * jp], A[1][st], b0, b1);
            sm90::mma_bf16_16816(acc[1][2 * jp + 1], A[1][st], b2, b3);
          }
        } else {
          uint32_t b0, b1;
          sm90::ldmatrix_x2(b0, b1, &sm.q[tq][lane & 7][16 * st + 8 * ((lane >> 3) & 1)]);
          sm90::mma_bf16_16816(acc[0][0], A[0][st], b0, b1);
          sm90::mma_bf16_16816(acc[1][0], A[1][st], b0, b1);
        }
      }
      // Epilogue: per key row, bf16(dot) -> relu -> bf16(* w) -> fp32 sum over heads.
      float sum[2][2];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        sum[m][0] = 0.0f;
        sum[m][1] = 0.0f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint32_t w2 = *reinterpret_cast<const uint32_t*>(&sm.w[tq][8 * j + 2 * c]);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            uint32_t v = sm90::pack_bf16x2(acc[m][j][2 * r], acc[m][j][2 * r + 1]);
            v = sm90::mul_bf16x2(sm90::max_bf16x2(v, 0u), w2);
            sum[m][r] = __fadd_rn(sum[m][r], sm90::bf16lo_to_float(v));
            sum[m][r] = __fadd_rn(sum[m][r], sm90::bf16hi_to_float(v));
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          sum[m][r] = __fadd_rn(sum[m][r], __shfl_xor_sync(0xffffffffu, sum[m][r], 1));
          sum[m][r] = __fadd_rn(sum[m][r], __shfl_xor_sync(0xffffffffu, sum[m][r], 2));
        }
      }
      // Lane c writes row (m, r) = (c / 2, c % 2): a warp stores 32 consecutive keys.
      const int m = c >> 1, r = c & 1;
      const float total =
          m == 0 ? (r == 0 ? sum[0][0] : sum[0][1]) : (r == 0 ? sum[1][0] : sum[1][1]);
      const float ks =
          m == 0 ? (r == 0 ? kscale[0][0] : kscale[0][1]) : (r == 0 ? kscale[1][0] : kscale[1][1]);
      const int key = kb + warp * kKeysPerWarp + 16 * m + 8 * r + g;
      const int nvis = (p_first + tq + 1) / a.ratio;
      if (key < nvis) {
        const uint16_t bits = sm90::float_to_bf16_bits(__fmul_rn(total, ks));
        reinterpret_cast<uint16_t*>(a.scores)[size_t(t0 + tq) * a.stride + key] = bits;
      }
    }
  }
  sm90::cp_async_wait<0>();
}

template <int HI>
void launch_logits(const IndexerParams& p, cudaStream_t stream) {
  // About 4 CTAs an SM, each covering at most kMaxKeysPerCta keys.
  const indexer_detail::LogitsGrid g =
      indexer_detail::logits_grid(p, kTileKeys, kMaxKeysPerCta, /*ctas_per_sm=*/4);
  const LogitsArgs a = indexer_detail::logits_args(p, g);
  const size_t smem = sizeof(LogitsSmem<HI>);
  static std::atomic<uint64_t> attr{0};
  once_per_device(attr, [&] {
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(indexer_logits_kernel<HI>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  });
  launch_kernel(LaunchConfig{g.grid, dim3(kLogitsThreads), smem, stream, p.pdl},
                indexer_logits_kernel<HI>, a);
}

}  // namespace

namespace indexer_detail {

LogitsGrid logits_grid(const IndexerParams& p, int tile_keys, int max_keys, int ctas_per_sm) {
  const int64_t nvis = max_visible(p);
  const int tiles = (p.batch.max_seq_tokens + kMaxTokensPerCta - 1) / kMaxTokensPerCta;
  DSV4_CHECK(tiles <= 65535 && p.batch.num_seqs <= 65535, "indexer_logits: grid too large (",
             p.batch.num_seqs, " sequences, ", p.batch.max_seq_tokens, " tokens per sequence)");
  const int64_t units = int64_t(p.batch.num_seqs) * tiles;
  const int64_t max_chunks = (nvis + tile_keys - 1) / tile_keys;
  int64_t chunks =
      std::clamp<int64_t>((ctas_per_sm * sm_count() + units - 1) / units, 1, max_chunks);
  int64_t kpc = (nvis + chunks - 1) / chunks;
  kpc = std::min<int64_t>((kpc + tile_keys - 1) / tile_keys * tile_keys, max_keys);
  chunks = (nvis + kpc - 1) / kpc;
  return {dim3(unsigned(chunks), unsigned(tiles), unsigned(p.batch.num_seqs)), int(kpc), tiles};
}

LogitsArgs logits_args(const IndexerParams& p, const LogitsGrid& g) {
  return {p.q_fp4,          p.weights, p.scores, p.score_stride, p.batch.cu_seqlens,
          p.batch.seq_pos0, p.keys,    p.ratio,  g.keys_per_cta, p.n_heads};
}

}  // namespace indexer_detail

void indexer_logits(const IndexerParams& p, cudaStream_t stream) {
  indexer_detail::validate(p, indexer_detail::Stage::kLogits);
  if (p.batch.num_tokens == 0 || indexer_detail::max_visible(p) == 0) return;
  if (p.logits_path != IndexerLogitsPath::kMma) {
    indexer_detail::launch_logits_wgmma(p, stream);
    return;
  }
  indexer_detail::with_head_width(p.n_heads, [&](auto hi) { launch_logits<hi()>(p, stream); });
}

}  // namespace dsv4::cuda
