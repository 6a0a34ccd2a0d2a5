// Sparse attention, mma.sync m16n8k16 kernel (every head count): one CTA per (query token,
// tile of HT heads, key split). Per 64-key block of the token's canonical key list:
//   gather  — cp.async of the 584-byte entries (window ring / staged batch entries /
//             compressed store) into a ring of raw FP8 blocks, kRawStages deep;
//   decode  — all threads turn the block into BF16 rows in smem (e4m3 x UE8M0 bit-exact,
//             RoPE dims copied), zero rows for invalid slots;
//   S       — warp (head group hg, dim group dg) computes 16 heads x 64/DG keys over all 512
//             dims, scaled into the exp2 domain, invalid keys -inf, into smem;
//   softmax — each warp reads its head group's 16 x 64 scores, updates the running max /
//             sum exactly as cpu::sparse_attention (P rounded to BF16 against the new max);
//   P.V     — 16 heads x its 512/DG output dims, V fragments by ldmatrix.trans of the same rows.
// Splits write unnormalised partials (O, m, l) that sparse_attention_combine.cu merges with
// the sink; a single split applies the sink and writes BF16 directly.
#include <cuda_bf16.h>

#include <cmath>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/common/sm90/bf16x2.cuh"
#include "ops/cuda/common/sm90/cp_async.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/common/sm90/warp_mma.cuh"
#include "ops/cuda/sparse_attention/decode.cuh"
#include "ops/cuda/sparse_attention/key_source.cuh"
#include "ops/cuda/sparse_attention/sparse_attention_config.h"
#include "ops/cuda/sparse_attention/sparse_attention_internal.h"

namespace dsv4::cuda::sparse_attn_detail {
namespace {

using namespace sparse_attn_cfg;
using namespace detail;

template <int HT>
constexpr size_t mma_smem_bytes() {
  using C = MmaCfg<HT>;
  return size_t(HT) * C::kRow * 2 + size_t(kKeyBlock) * C::kRow * 2 + size_t(HT) * C::kSRow * 4 +
         size_t(C::kRawStages) * kKeyBlock * C::kRawRow + size_t(C::kRawStages) * kKeyBlock;
}

template <int HT>
__global__ void __launch_bounds__(MmaCfg<HT>::kThreads, 1)
    sparse_attn_mma_kernel(const AttnArgs a) {
  using C = MmaCfg<HT>;
  constexpr int DG = C::kDimGroups, DW = C::kDimsPerWarp, KW = C::kKeysPerWarp;
  constexpr int kRow = C::kRow, kSRow = C::kSRow, kRawRow = C::kRawRow, kStages = C::kRawStages;
  static_assert(KW == 8 || KW % 16 == 0, "keys per warp");

  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* kb = q_s + HT * kRow;
  float* s_s = reinterpret_cast<float*>(kb + kKeyBlock * kRow);
  uint8_t* raw = reinterpret_cast<uint8_t*>(s_s + HT * kSRow);
  uint8_t* valid = raw + kStages * kKeyBlock * kRawRow;

  // Launched programmatically (a.pdl): nothing is read before the kernel before is complete.
  // The combine (a programmatic dependent) may launch once every CTA has started; it still
  // waits for this grid to complete before reading the partials.
  sm90::griddep_wait();
  sm90::griddep_launch_dependents();
  const int t = blockIdx.x / a.head_tiles;
  const int h0 = (blockIdx.x % a.head_tiles) * HT;
  const int split = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // The top-k entries of this thread's key in the split's first two blocks, requested before
  // the query's sequence and position (they need only t): at small batch, where a CTA gathers
  // one or two blocks, that takes one round trip off the chain to the first key bytes.
  const int ld_key = tid >> 2, ld_part = tid & 3;
  const int first_slot = split * a.blocks_per_split * kKeyBlock + ld_key;
  const int topk_first = key_topk_entry(a, t, first_slot);
  const int topk_second = key_topk_entry(a, t, first_slot + kKeyBlock);
  const QueryInfo qi = query_info(a, t);
  const int nblk = (qi.nkeys + kKeyBlock - 1) / kKeyBlock;
  const int blk_begin = split * a.blocks_per_split;
  const int blk_end = min(nblk, blk_begin + a.blocks_per_split);

  const int g = lane >> 2, c = lane & 3;
  const int hg = warp / DG, dg = warp % DG;

  if (blk_begin >= blk_end) {  // an empty split: m = -inf marks it for the combine
    if (tid < HT && h0 + tid < a.n_heads) {
      float* part = a.partials +
                    ((int64_t(t) * a.n_heads + h0 + tid) * a.num_splits + split) * kPartialFloats;
      part[kHeadDim] = -INFINITY;
      part[kHeadDim + 1] = 0.0f;
    }
    return;
  }

  // Q tile (rows past n_heads zero), committed with the first raw block.
  for (int i = tid; i < HT * (kHeadDim / 8); i += C::kThreads) {
    const int r = i / (kHeadDim / 8), ch = i % (kHeadDim / 8);
    __nv_bfloat16* dst = q_s + r * kRow + 8 * ch;
    if (h0 + r < a.n_heads)
      sm90::cp_async_16(dst, a.q + (int64_t(t) * a.n_heads + h0 + r) * kHeadDim + 8 * ch);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }

  // Raw block loader: 4 threads per key, 9 x 16 B of data each, interleaved (thread part p
  // copies chunks p, p + 4, ...), so each copy instruction of a warp reads 64 contiguous bytes
  // of each of its 8 keys — two whole sectors, each requested once — rather than 16-byte
  // pieces 144 bytes apart; part 0 also copies the scales. The
  // key lookups run ahead of the copies (key_source.cuh's stages): when block n is issued its
  // page is known, block n + 1's page and block n + 2's top-k entry are requested, so an issue
  // never waits for a lookup (the first block's excepted).
  auto slot_of = [&](int blk) { return blk * kKeyBlock + ld_key; };
  int next_blk = blk_begin;  // the next block to issue
  KeyLoc next_loc = key_locate(a, qi, slot_of(blk_begin), topk_first);
  int next_topk = topk_second;
  auto issue = [&](int stage) {
    const KeyAddr src = key_address(a, next_loc);
    const bool ok = src.data != nullptr;
    uint8_t* dst = raw + (stage * kKeyBlock + ld_key) * kRawRow;
#pragma unroll
    for (int i = 0; i < 9; ++i) {
      const int off = 16 * (ld_part + 4 * i);
      if (ok)
        sm90::cp_async_16(dst + off, src.data + off);
      else
        *reinterpret_cast<uint4*>(dst + off) = make_uint4(0, 0, 0, 0);
    }
    if (ld_part == 0) {
      if (ok)
        sm90::cp_async_8(dst + kEntryData, src.scales);
      else
        *reinterpret_cast<uint2*>(dst + kEntryData) = make_uint2(0, 0);
      valid[stage * kKeyBlock + ld_key] = ok ? 1 : 0;
    }
    ++next_blk;
    if (next_blk < blk_end) next_loc = key_locate(a, qi, slot_of(next_blk), next_topk);
    if (next_blk + 1 < blk_end) next_topk = key_topk_entry(a, qi, slot_of(next_blk + 1));
  };

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (blk_begin + st < blk_end) issue(st);
    sm90::cp_async_commit();
  }

  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
  float o[DW / 8][4];
#pragma unroll
  for (int n = 0; n < DW / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;

#pragma unroll 1
  for (int blk = blk_begin; blk < blk_end; ++blk) {
    const int it = blk - blk_begin;
    const int stage = it % kStages;
    sm90::cp_async_wait<kStages - 2>();
    __syncthreads();  // raw[stage] landed; every warp is done with kb / s_s of the last block
    if (blk + kStages - 1 < blk_end) issue((it + kStages - 1) % kStages);
    sm90::cp_async_commit();

    // Decode: thread (key, part) converts 16-byte chunks part, part+4, ... of the NoPE bytes
    // and two 16-byte chunks of the RoPE tail.
    {
      const int key = tid >> 2, part = tid & 3;
      const uint8_t* src = raw + (stage * kKeyBlock + key) * kRawRow;
      __nv_bfloat16* dst = kb + key * kRow;
#pragma unroll
      for (int i = 0; i < kNopeDim / 16 / 4; ++i) {
        const int ch = part + 4 * i;
        const uint4 w = *reinterpret_cast<const uint4*>(src + 16 * ch);
        const int code = src[kEntryData + ch / 4];
        const uint32_t scale2 = bf16x2_pow2(code - 127 + 120);
        uint4 lo, hi;
        e4m3x4_to_bf16x4(w.x, scale2, lo.x, lo.y);
        e4m3x4_to_bf16x4(w.y, scale2, lo.z, lo.w);
        e4m3x4_to_bf16x4(w.z, scale2, hi.x, hi.y);
        e4m3x4_to_bf16x4(w.w, scale2, hi.z, hi.w);
        *reinterpret_cast<uint4*>(dst + 16 * ch) = lo;
        *reinterpret_cast<uint4*>(dst + 16 * ch + 8) = hi;
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int ch = 2 * part + i;  // 8 BF16 each
        *reinterpret_cast<uint4*>(dst + kNopeDim + 8 * ch) =
            *reinterpret_cast<const uint4*>(src + kNopeDim + 16 * ch);
      }
    }
    __syncthreads();  // kb holds the block

    // S = Q K^T for 16 heads x KW keys, all 512 dims.
    {
      float acc[KW / 8][4];
#pragma unroll
      for (int n = 0; n < KW / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
      const __nv_bfloat16* qrow = q_s + (16 * hg + (lane & 15)) * kRow + 8 * (lane >> 4);
#pragma unroll 4
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t af[4];
        sm90::ldmatrix_x4(af[0], af[1], af[2], af[3], qrow + 16 * ks);
        if constexpr (KW >= 16) {
#pragma unroll
          for (int np = 0; np < KW / 16; ++np) {
            uint32_t b0, b1, b2, b3;
            sm90::ldmatrix_x4(b0, b1, b2, b3,
                              kb + (KW * dg + 16 * np + 8 * (lane >> 4) + (lane & 7)) * kRow +
                                  16 * ks + 8 * ((lane >> 3) & 1));
            sm90::mma_bf16_16816(acc[2 * np], af, b0, b1);
            sm90::mma_bf16_16816(acc[2 * np + 1], af, b2, b3);
          }
        } else {
          uint32_t b0, b1;
          sm90::ldmatrix_x2(b0, b1,
                            kb + (KW * dg + (lane & 7)) * kRow + 16 * ks + 8 * ((lane >> 3) & 1));
          sm90::mma_bf16_16816(acc[0], af, b0, b1);
        }
      }
      const uint8_t* vld = valid + stage * kKeyBlock;
#pragma unroll
      for (int n = 0; n < KW / 8; ++n) {
        const int key = KW * dg + 8 * n + 2 * c;
        const bool v0 = vld[key] != 0, v1 = vld[key + 1] != 0;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float2 sv;
          sv.x = v0 ? acc[n][2 * r] * a.scale_log2 : -INFINITY;
          sv.y = v1 ? acc[n][2 * r + 1] * a.scale_log2 : -INFINITY;
          *reinterpret_cast<float2*>(s_s + (16 * hg + g + 8 * r) * kSRow + key) = sv;
        }
      }
    }
    __syncthreads();  // the head group's scores are complete

    // Online softmax over the block (rows g and g+8 of the head group), then O += P V.
    {
      float sv[4][2][2][2];  // [key step][half][row][pair]
      float bmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float2 v = *reinterpret_cast<const float2*>(s_s + (16 * hg + g + 8 * r) * kSRow +
                                                              16 * kk + 8 * hf + 2 * c);
            sv[kk][hf][r][0] = v.x;
            sv[kk][hf][r][1] = v.y;
            bmax[r] = fmaxf(bmax[r], fmaxf(v.x, v.y));
          }
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        bmax[r] = fmaxf(bmax[r], __shfl_xor_sync(0xffffffffu, bmax[r], 1));
        bmax[r] = fmaxf(bmax[r], __shfl_xor_sync(0xffffffffu, bmax[r], 2));
        const float m_new = fmaxf(m_r[r], bmax[r]);
        // A block with no valid key yet changes nothing (m stays -inf, p = 0).
        alpha[r] = m_new == -INFINITY ? 1.0f : exp2f(m_r[r] - m_new);
        m_r[r] = m_new;
      }
      uint32_t pa[4][4];
      float bsum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float mm = m_r[r] == -INFINITY ? 0.0f : m_r[r];
            const float p0 = exp2f(sv[kk][hf][r][0] - mm), p1 = exp2f(sv[kk][hf][r][1] - mm);
            bsum[r] += p0 + p1;
            pa[kk][2 * hf + r] = sm90::pack_bf16x2(p0, p1);
          }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        bsum[r] += __shfl_xor_sync(0xffffffffu, bsum[r], 1);
        bsum[r] += __shfl_xor_sync(0xffffffffu, bsum[r], 2);
        l_r[r] = l_r[r] * alpha[r] + bsum[r];
      }
#pragma unroll
      for (int n = 0; n < DW / 8; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const __nv_bfloat16* vrow = kb + (16 * kk + (lane & 15)) * kRow + DW * dg + 8 * (lane >> 4);
#pragma unroll
        for (int dp = 0; dp < DW / 16; ++dp) {
          uint32_t b0, b1, b2, b3;
          sm90::ldmatrix_x4_trans(b0, b1, b2, b3, vrow + 16 * dp);
          sm90::mma_bf16_16816(o[2 * dp], pa[kk], b0, b1);
          sm90::mma_bf16_16816(o[2 * dp + 1], pa[kk], b2, b3);
        }
      }
    }
  }
  sm90::cp_async_wait<0>();

  // Epilogue: rows g, g+8 of the head group; this warp's DW output dims.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + 16 * hg + g + 8 * r;
    if (h >= a.n_heads) continue;
    if (a.num_splits == 1) {
      const float m = m_r[r];
      float inv = 0.0f;  // no valid key: the reference's acc / inf = 0
      if (m != -INFINITY)
        inv = 1.0f / (l_r[r] + exp2f(__ldg(a.sink + h) * 1.4426950408889634f - m));
      __nv_bfloat16* orow = a.out + (int64_t(t) * a.n_heads + h) * kHeadDim + DW * dg + 2 * c;
#pragma unroll
      for (int n = 0; n < DW / 8; ++n)
        *reinterpret_cast<uint32_t*>(orow + 8 * n) =
            sm90::pack_bf16x2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    } else {
      float* part =
          a.partials + ((int64_t(t) * a.n_heads + h) * a.num_splits + split) * kPartialFloats;
#pragma unroll
      for (int n = 0; n < DW / 8; ++n)
        *reinterpret_cast<float2*>(part + DW * dg + 8 * n + 2 * c) =
            make_float2(o[n][2 * r], o[n][2 * r + 1]);
      if (dg == 0 && c == 0) {
        part[kHeadDim] = m_r[r];
        part[kHeadDim + 1] = l_r[r];
      }
    }
  }
}

template <int HT>
void launch_mma_t(const AttnArgs& a, cudaStream_t stream) {
  constexpr size_t smem = mma_smem_bytes<HT>();
  static std::atomic<uint64_t> attr{0};
  once_per_device(attr, [] {
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(sparse_attn_mma_kernel<HT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  });
  const dim3 grid(unsigned(int64_t(a.num_tokens) * a.head_tiles), unsigned(a.num_splits));
  launch_kernel(LaunchConfig{grid, dim3(MmaCfg<HT>::kThreads), smem, stream, a.pdl},
                sparse_attn_mma_kernel<HT>, a);
}

}  // namespace

void launch_mma(const AttnArgs& a, int heads_per_cta, cudaStream_t stream) {
  switch (heads_per_cta) {
    case 16:
      launch_mma_t<16>(a, stream);
      break;
    case 32:
      launch_mma_t<32>(a, stream);
      break;
    case 64:
      launch_mma_t<64>(a, stream);
      break;
    default:
      DSV4_CHECK(false, "sparse_attention: heads_per_cta ", heads_per_cta, " unsupported");
  }
}

}  // namespace dsv4::cuda::sparse_attn_detail
