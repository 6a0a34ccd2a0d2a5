// Indexer logits on warpgroup MMA (issue 17 point 3): one warpgroup per CTA computes the dot
// products of 64 keys with every head of a query token in one wgmma chain (M = 64 keys, N = the
// heads, K = the 128 key dims, BF16), the keys decoded from MXFP4 straight into the A register
// fragments, the token's FP4-faked queries the B operand in shared memory; then the reference's
// epilogue
//   score = bf16( sum_h bf16( relu(bf16(q_h . k)) * w_h ) ).
//
// Why this shape: at s_q 1 a key is used by one token, so the kernel must stream the MXFP4 cache
// (68 bytes a key) while the tensor cores do 64 x 128 x 2 = 16K FLOPs a key (241 a byte);
// mma.sync (indexer_logits.cu) reached 0.80-0.86 TB/s of keys on the H200. Per 64-key tile the
// warpgroup issues 8 wgmma (one per k16 step) per token; its ALU work is the key decode (one bit
// placement and one BF16 multiply per pair of values) and the epilogue.
//
// Key decode (exact): an e2m1 code s|e1 e0 m placed as BF16 bits s at 15, e1 e0 m at 8..6 is the
// code's value times 2^-126 for every code (normal and the subnormal 0.5 alike: the BF16
// exponent field takes e1 e0, the mantissa's top bit m), so one BF16 multiply by 2^(126 + d),
// d = the block's scale exponent minus the key's largest, gives the value times 2^d exactly
// wherever that is a BF16 value (the same relative scaling, with the same range, as the mma.sync
// kernel; the largest power of two multiplies the fp32 head sum, which commutes with every BF16
// rounding). The bit placement pairs nibble j with
// nibble j + 4 of a 32-bit word, so the fragment's k order is a fixed permutation of the key
// dims; the queries are staged in smem in the same order, which leaves every dot unchanged.
//
// Head sum: relu and the BF16 rounding in one cvt.rn.relu.bf16x2, the weight in one BF16
// multiply; the accumulator layout of the dot products is the A-fragment layout of a second
// wgmma (M = 64 keys, K = the heads) against a ones matrix, so the tensor cores add the BF16
// terms in fp32 (measured 3-8 % faster at batch 128-256 than adding them on the ALUs per lane
// and across the lane quad, as the mma.sync kernel does; H200, 2026-12-04). Any order gives the
// CPU op's sequential fp32 sum whenever that sum is exact; where it rounds, orders can differ by
// an fp32 ulp, which changes the BF16 score only at a rounding midpoint.
//
// Sequences with 3 or more query tokens run two tokens a chain (N = 2 x heads; the queries of a
// CTA's tokens lie as one K-major tile of tokens x heads rows).
//
// Pipeline: key tiles land in a 4-stage ring (bulk copies when a tile lies in one page, else
// cp.async per key); the warps decode tile i + 1 into a second set of fragments while the
// tensor cores run tile i's chain.
#include <cuda_bf16.h>

#include <atomic>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/common/sm90/bf16x2.cuh"
#include "ops/cuda/common/sm90/cp_async.cuh"
#include "ops/cuda/common/sm90/mbarrier.cuh"
#include "ops/cuda/common/sm90/smem.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/common/sm90/tma.cuh"
#include "ops/cuda/common/sm90/wgmma.cuh"
#include "ops/cuda/indexer/indexer_config.h"
#include "ops/cuda/indexer/indexer_internal.h"
#include "ops/cuda/indexer/indexer_logits_args.h"
#include "ops/cuda/sparse_attention/decode.cuh"

namespace dsv4::cuda::indexer_detail {
namespace {

using namespace indexer_cfg;
using namespace ::dsv4::cuda::detail;

static_assert(kWgMaxKeysPerCta / kWgTileKeys <= kWgThreads, "one thread a tile's page id");

// Shared memory of one CTA (offsets in bytes from a 1024-aligned base).
//   q     : 2 regions x tokens x HI rows x 128 B (128-byte swizzle, K-major; region r holds
//           logical k columns 64r .. 64r + 63)
//   ones  : 8 rows x 128 B of BF16 1.0 (the head-sum B operand)
//   kd    : stages x 64 keys x 64 B (packed e2m1)
//   ks    : stages x 64 keys x 4 B (UE8M0 codes)
//   w     : tokens x HI BF16 head weights
//   full  : stages mbarriers (a key tile landed)
//   page  : the page id of each key tile of the CTA (bulk path)
//   nvis  : each token's visible entries
struct WgLayout {
  int q, ones, kd, ks, w, full, page, nvis, bytes;
  __host__ __device__ WgLayout(int hi, int tokens) {
    q = 0;
    ones = q + tokens * 2 * hi * 128;
    kd = ones + 1024;
    ks = kd + kWgStages * kWgTileKeys * kKeyBytes;
    w = ks + kWgStages * kWgTileKeys * kKeyScales;
    full = (w + kMaxTokensPerCta * hi * 2 + 7) / 8 * 8;
    page = full + kWgStages * 8;
    nvis = page + (kWgMaxKeysPerCta / kWgTileKeys) * 4;
    bytes = nvis + kMaxTokensPerCta * 4;
  }
};

// Logical k column of fragment pair (step st, half h) for quad lane c, element e (0 low, 1 high)
// is 16 st + 8 h + 2 c + e; it holds physical key dim 32 c + kphys(st, h) + 4 e.
__device__ __forceinline__ int kphys(int st, int h) {
  return 8 * (st >> 1) + 2 * (st & 1) + h;
}

// Byte offset of BF16 element (row, col) of the queries' K-major tile: 2 regions (k columns
// 0..63, 64..127) of `rows` rows (tokens x heads, a token's heads contiguous, so consecutive
// tokens form one wider B operand).
__device__ __forceinline__ uint32_t q_offset(int rows, int row, int col) {
  return uint32_t(col >> 6) * uint32_t(rows * 128) + uint32_t(row) * 128u +
         (uint32_t(((col & 63) >> 3) ^ (row & 7)) << 4) + uint32_t(col & 7) * 2u;
}

// Eight e2m1 codes (nibble j = element j) -> four BF16x2 words: word j holds elements j (low)
// and j + 4 (high), each times 2^-126 (see the file comment); the caller multiplies by 2^126+d.
__device__ __forceinline__ void place_e2m1x8(uint32_t w, uint32_t (&o)[4]) {
  constexpr uint32_t kMag = 0x01C001C0u, kSign = 0x80008000u;
  o[0] = ((w << 6) & kMag) | ((w << 12) & kSign);
  o[1] = ((w << 2) & kMag) | ((w << 8) & kSign);
  o[2] = ((w >> 2) & kMag) | ((w << 4) & kSign);
  o[3] = ((w >> 6) & kMag) | (w & kSign);
}

// cvt.rn.relu: bf16(x) clamped at 0 (a negative result becomes +0), `lo` in the low half.
__device__ __forceinline__ uint32_t relu_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <int HI, int TP>
__global__ void __launch_bounds__(kWgThreads, TP == 1 ? kWgMinCtasPerSm : kWgMinCtasPerSmPaired)
    indexer_logits_wgmma_kernel(const LogitsArgs a) {
  constexpr int NT = HI / 8;                  // n8 tiles of heads
  constexpr int KS = HI >= 16 ? HI / 16 : 1;  // k16 steps of the head sum
  extern __shared__ __align__(16) uint8_t smem_dyn[];
  // The swizzled tiles need 1024-byte alignment (the launch adds 1024 bytes for it).
  uint8_t* const smem_raw = smem_dyn + ((1024u - (sm90::smem_u32(smem_dyn) & 1023u)) & 1023u);
  // Launched programmatically (IndexerParams::pdl): nothing is read before the kernel before
  // is complete.
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();

  LogitsCta cta;
  if (!logits_cta(a, cta)) return;
  const int s = cta.s, nt = cta.nt, t0 = cta.t0, p_first = cta.p_first;
  const int k_begin = cta.k_begin, k_end = cta.k_end;
  const int ntiles = (k_end - k_begin + kWgTileKeys - 1) / kWgTileKeys;

  const WgLayout L(HI, a.cta_tokens);
  const int q_rows = a.cta_tokens * HI;  // the queries' tile: tokens x heads rows a region
  uint8_t* const sq = smem_raw + L.q;
  uint8_t* const skd = smem_raw + L.kd;
  uint32_t* const sks = reinterpret_cast<uint32_t*>(smem_raw + L.ks);
  __nv_bfloat16* const sw = reinterpret_cast<__nv_bfloat16*>(smem_raw + L.w);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;

  uint64_t* const full = reinterpret_cast<uint64_t*>(smem_raw + L.full);
  int32_t* const tile_page = reinterpret_cast<int32_t*>(smem_raw + L.page);
  int32_t* const tok_nvis = reinterpret_cast<int32_t*>(smem_raw + L.nvis);
  // Bulk path: a tile of 64 keys (64-aligned) lies in one page when the page size is a multiple
  // of 64: its 4096 data bytes and 256 scale bytes are two contiguous runs, copied by one thread
  // with the bulk-copy engine. Otherwise every key is fetched on its own (cp.async).
  const bool bulk = a.keys.page_size % kWgTileKeys == 0;
  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < kWgStages; ++st) sm90::mbar_init(&full[st], bulk ? 1 : kWgThreads);
    sm90::fence_barrier_init();
  }
  if (bulk && tid < ntiles)
    tile_page[tid] = __ldg(a.keys.block_table + int64_t(s) * a.keys.stride +
                           (k_begin + tid * kWgTileKeys) / a.keys.page_size);
  if (tid < nt) tok_nvis[tid] = (p_first + tid + 1) / a.ratio;
  __syncthreads();
  const uint64_t policy = a.keys_read_once ? sm90::kEvictFirst : sm90::kEvictNormal;

  // Key tile `it` into `stage`. Per-key path: 64 keys x 64 data bytes as 256 16-byte chunks
  // (two a thread: key tid / 4 and 32 + tid / 4, part tid % 4), the scale words by threads
  // 0..63, keys past k_end zero. Bulk path: keys past k_end are whatever the page holds (their
  // rows are computed and never stored; the MMA keeps rows apart).
  auto load_tile = [&](int it, int stage) {
    const int kb = k_begin + it * kWgTileKeys;
    if (bulk) {
      if (tid == 0) {
        const int slot = kb % a.keys.page_size;
        const uint8_t* page = a.keys.pages + int64_t(tile_page[it]) * a.keys.page_bytes;
        sm90::mbar_arrive_expect_tx(&full[stage], kWgTileKeys * (kKeyBytes + kKeyScales));
        sm90::bulk_load(skd + stage * kWgTileKeys * kKeyBytes, page + int64_t(slot) * kKeyBytes,
                        kWgTileKeys * kKeyBytes, &full[stage], policy);
        sm90::bulk_load(sks + stage * kWgTileKeys,
                        page + int64_t(a.keys.page_size) * kKeyBytes + int64_t(slot) * kKeyScales,
                        kWgTileKeys * kKeyScales, &full[stage], policy);
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = 32 * j + (tid >> 2), part = tid & 3;
      uint8_t* dst = skd + (stage * kWgTileKeys + row) * kKeyBytes + 16 * part;
      const int key = kb + row;
      if (key < k_end)
        sm90::cp_async_16(dst, entry_data(a.keys, s, key) + 16 * part);
      else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
    if (tid < kWgTileKeys) {
      const int key = kb + tid;
      uint32_t* dst = sks + stage * kWgTileKeys + tid;
      if (key < k_end)
        sm90::cp_async_4(dst, entry_scales(a.keys, s, key));
      else
        *dst = 0;
    }
    sm90::cp_async_mbar_arrive_noinc(&full[stage]);
  };
#pragma unroll
  for (int st = 0; st < kWgStages; ++st)
    if (st < ntiles) load_tile(st, st);

  // Queries in the fragment's k order (work item = token, head, 32-dim block c: 64 source
  // bytes -> 16 BF16x2 words, one per (step, half)), the weights, the ones matrix.
  {
    const int H = a.heads;
    for (int i = tid; i < nt * HI * 4; i += kWgThreads) {
      const int cb = i & 3, h = (i >> 2) % HI, tq = (i >> 2) / HI;
      uint32_t v[16];
      if (h < H) {
        const uint4* src = reinterpret_cast<const uint4*>(
            a.q_fp4 + (size_t(t0 + tq) * H + h) * kHeadDim + 32 * cb);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4 x = __ldg(src + j);
          v[4 * j] = x.x;
          v[4 * j + 1] = x.y;
          v[4 * j + 2] = x.z;
          v[4 * j + 3] = x.w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = 0u;  // padding heads: zero queries
      }
#pragma unroll
      for (int st = 0; st < 8; ++st)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int b = kphys(st, hf);  // dims b (low) and b + 4 (high) of the block
          const uint32_t word = sm90::prmt(v[b >> 1], v[(b >> 1) + 2], (b & 1) ? 0x7632u : 0x5410u);
          *reinterpret_cast<uint32_t*>(
              sq + q_offset(q_rows, tq * HI + h, 16 * st + 8 * hf + 2 * cb)) = word;
        }
    }
    for (int i = tid; i < nt * HI; i += kWgThreads) {
      const int tq = i / HI, h = i % HI;
      sw[tq * HI + h] = h < H ? a.weights[size_t(t0 + tq) * H + h] : __float2bfloat16_rn(0.0f);
    }
    uint32_t* ones = reinterpret_cast<uint32_t*>(smem_raw + L.ones);
    for (int i = tid; i < 256; i += kWgThreads) ones[i] = 0x3F803F80u;
    sm90::fence_proxy_async_smem();  // the wgmma reads them through the async proxy
  }
  const uint64_t q_desc = sm90::make_smem_desc_sw128(sm90::smem_u32(sq), 16u, 1024u);
  const uint64_t ones_desc =
      sm90::make_smem_desc_sw128(sm90::smem_u32(smem_raw + L.ones), 16u, 1024u);

  // Decodes key tile `it` (its stage has landed) into this warp's A fragments: rows g and g + 8
  // of its m16 slice; A[st][0..3] = the k16 step's {row g pair c, row g+8 pair c, row g pair
  // c+4, row g+8 pair c+4}; kscale = each row's largest block scale.
  auto decode = [&](int it, uint32_t(&A)[8][4], float(&kscale)[2]) {
    const int stage = it % kWgStages;
    sm90::mbar_wait(&full[stage], uint32_t(it / kWgStages) & 1u);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * warp + 8 * r + g;
      const uint4 d =
          *reinterpret_cast<const uint4*>(skd + (stage * kWgTileKeys + row) * kKeyBytes + 16 * c);
      const uint32_t sc = sks[stage * kWgTileKeys + row];
      const int emax = max(max(int(sc & 0xff), int((sc >> 8) & 0xff)),
                           max(int((sc >> 16) & 0xff), int(sc >> 24)));
      const int ec = (sc >> (8 * c)) & 0xff;
      const uint32_t scale2 = bf16x2_pow2(126 + ec - emax);
      kscale[r] = e8m0_to_float(uint32_t(emax));
      const uint32_t words[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) {
        uint32_t o[4];
        place_e2m1x8(words[wd], o);
        // Word j of source word wd is (step 2 wd + j / 2, half j % 2): kphys(st, h) = 8 wd + j.
#pragma unroll
        for (int j = 0; j < 4; ++j)
          A[2 * wd + (j >> 1)][r + 2 * (j & 1)] = sm90::mul_bf16x2(o[j], scale2);
      }
    }
  };

  // Tile `it` (decoded in A): for each token the dot chain, then the epilogue. While the first
  // token's chain runs on the tensor cores, the warps decode tile it + 1 into An.
  auto process = [&](int it, uint32_t(&A)[8][4], const float(&kscale)[2], uint32_t(&An)[8][4],
                     float(&kscalen)[2]) {
    __syncthreads();  // every warp decoded tile it (last iteration): its stage may be refilled
    if (it + kWgStages < ntiles) load_tile(it + kWgStages, it % kWgStages);
    const int kb = k_begin + it * kWgTileKeys;
#pragma unroll 1
    for (int tq = 0; tq < nt; tq += TP) {
      // Tokens tq .. tq + TP - 1 in one chain (N = TP x HI; a token past nt computes garbage
      // columns that are never stored).
      float acc[TP * HI / 2];
#pragma unroll
      for (int st = 0; st < 8; ++st)
#pragma unroll
        for (int e = 0; e < 4; ++e) sm90::warpgroup_fence_operand(A[st][e]);
      sm90::warpgroup_fence_operands(acc);
      sm90::warpgroup_arrive();
      const uint64_t qt = q_desc + uint64_t((tq * HI * 128) >> 4);
#pragma unroll
      for (int st = 0; st < 8; ++st)
        sm90::Bf16MmaRS<TP * HI>::wgmma(
            A[st], qt + uint64_t(((st >> 2) * q_rows * 128 + (st & 3) * 32) >> 4), acc, st > 0);
      sm90::warpgroup_commit_batch();
      if (tq == 0 && it + 1 < ntiles) decode(it + 1, An, kscalen);
      sm90::warpgroup_wait<0>();
      sm90::warpgroup_fence_operands(acc);

      // Terms bf16(relu(bf16(dot)) * w) as the A fragments of D[64 x 8] = T[64 x HI] *
      // ones[HI x 8] (one chain a token): n8 tile j (heads 8j + 2c, +1) is k step j / 2,
      // registers {row g, row g + 8} + 2 (j % 2).
      uint32_t F[TP][KS][4];
#pragma unroll
      for (int u = 0; u < TP; ++u) {
        const __nv_bfloat16* wt = sw + (tq + u) * HI;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint32_t w2 = *reinterpret_cast<const uint32_t*>(wt + 8 * j + 2 * c);
          const float* d = acc + u * (HI / 2) + 4 * j;
          F[u][j >> 1][2 * (j & 1)] = sm90::mul_bf16x2(relu_bf16x2(d[0], d[1]), w2);
          F[u][j >> 1][2 * (j & 1) + 1] = sm90::mul_bf16x2(relu_bf16x2(d[2], d[3]), w2);
        }
        if constexpr (NT == 1) F[u][0][2] = F[u][0][3] = 0u;
      }
      float sum[TP][4];
#pragma unroll
      for (int u = 0; u < TP; ++u) {
#pragma unroll
        for (int k = 0; k < KS; ++k)
#pragma unroll
          for (int e = 0; e < 4; ++e) sm90::warpgroup_fence_operand(F[u][k][e]);
        sm90::warpgroup_fence_operands(sum[u]);
      }
      sm90::warpgroup_arrive();
#pragma unroll
      for (int u = 0; u < TP; ++u)
#pragma unroll
        for (int k = 0; k < KS; ++k)
          sm90::Bf16MmaRS<8>::wgmma(F[u][k], ones_desc + uint64_t(2 * k), sum[u], k > 0);
      sm90::warpgroup_commit_batch();
      sm90::warpgroup_wait<0>();
#pragma unroll
      for (int u = 0; u < TP; ++u) sm90::warpgroup_fence_operands(sum[u]);
      // Lane c = r stores row r (keys 16 warp + g and + 8) of each token; + 0.0f makes an
      // all-zero sum +0 as the CPU's sum (which starts from +0) is.
      if (c < 2) {
        const int key = kb + 16 * warp + 8 * c + g;
#pragma unroll
        for (int u = 0; u < TP; ++u) {
          if (tq + u < nt && key < tok_nvis[tq + u]) {
            const float x = __fadd_rn(c == 0 ? sum[u][0] : sum[u][2], 0.0f);
            const uint16_t bits =
                sm90::float_to_bf16_bits(__fmul_rn(x, c == 0 ? kscale[0] : kscale[1]));
            reinterpret_cast<uint16_t*>(a.scores)[size_t(t0 + tq + u) * a.stride + key] = bits;
          }
        }
      }
    }
  };

  // Two fragment buffers, alternating: tile it is processed from one while tile it + 1 is
  // decoded into the other.
  uint32_t A0[8][4], A1[8][4];
  float ks0[2], ks1[2];
  decode(0, A0, ks0);
#pragma unroll 1
  for (int it = 0; it < ntiles; it += 2) {
    process(it, A0, ks0, A1, ks1);
    if (it + 1 < ntiles) process(it + 1, A1, ks1, A0, ks0);
  }
}

template <int HI, int TP>
void launch(const IndexerParams& p, cudaStream_t stream) {
  const LogitsGrid g = logits_grid(p, kWgTileKeys, kWgMaxKeysPerCta, kWgCtasPerSm);
  // Tokens a CTA holds (rounded up to whole pairs).
  const int tokens_per_cta =
      g.token_tiles > 1 ? kMaxTokensPerCta : (p.batch.max_seq_tokens + TP - 1) / TP * TP;
  LogitsArgs a = logits_args(p, g);
  a.cta_tokens = tokens_per_cta;
  a.keys_read_once = g.token_tiles == 1;
  const size_t smem = size_t(WgLayout(HI, tokens_per_cta).bytes) + 1024;  // + base alignment
  static std::atomic<uint64_t> attr{0};
  once_per_device(attr, [&] {
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(indexer_logits_wgmma_kernel<HI, TP>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(WgLayout(HI, kMaxTokensPerCta).bytes + 1024)));
  });
  launch_kernel(LaunchConfig{g.grid, dim3(kWgThreads), smem, stream, p.pdl},
                indexer_logits_wgmma_kernel<HI, TP>, a);
}

}  // namespace

void launch_logits_wgmma(const IndexerParams& p, cudaStream_t stream) {
  // Two tokens a chain (N = 2 x heads) when sequences have 3 or more query tokens: measured
  // 0-13 % faster at s_q 4 and 8-9 % at 4K / 8K prefill, but at s_q 2 from 14 % faster (16K)
  // to 15 % slower (b <= 2 at 128K; 1-2 % at b >= 128), the paired kernel holding half the CTAs
  // an SM (167 registers a thread against 128). H200, 2026-12-04, indexer_bench --logits.
  with_head_width(p.n_heads, [&](auto hi) {
    if (p.batch.max_seq_tokens >= 3)
      launch<hi(), 2>(p, stream);
    else
      launch<hi(), 1>(p, stream);
  });
}

}  // namespace dsv4::cuda::indexer_detail
