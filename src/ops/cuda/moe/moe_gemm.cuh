// Grouped FP4 expert GEMM, W4A16 on Hopper: one persistent launch runs every (token tile of
// an expert) x (block of weight rows) work item of a MoE layer.
//
// Per CTA tile: D[BM weight rows, BN tokens] = W_e[rows, K] * X[tokens, K]^T, fp32 accumulators
// in registers. Mainloop per stage (KC k-blocks of 64): all threads cp.async the packed FP4
// tiles of their rows (contiguous along K) and the BN activation rows (gathered by position,
// K-major, 128-byte swizzle) STAGES-2 stages ahead; each warpgroup reads its 16-byte share of
// a weight tile, turns each k16 step into BF16 A fragments in registers (exact e2m1 * scale,
// fp4_pack.h) and issues m64nBNk16 wgmmas with B from shared memory; the dequantisation of
// wgmma group g (into one of two A register buffers) overlaps the MMA of group g-1 (reading
// the other).
// Epilogues: gate/up (interleaved w1/w3 rows): a = bf16(w_pos * silu(min(g, L)) *
// clamp(u, -L, L)) with g, u the BF16-rounded projections; down: BF16 of the projection.
//
// Why BF16 MMA (W4A16) and not FP8 (W4A8): e2m1 x UE8M0 and e2m1 x E4M3 have at most 6
// significant bits, exact in BF16 (8) but not in e4m3 (4), and the FP8-fake-quantised
// activations are exact BF16 values, so one mainloop computes the reference's products
// exactly for both formats. FP8 would need NVFP4's per-16 scales outside the MMA (K = 32 per
// FP8 wgmma: split or zero-padded MMAs) and per-32 promotions for MXFP4; decode is bound by
// HBM either way, and prefill is judged against the chosen format's tensor-core rate.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/moe/fp4_pack.h"
#include "ops/cuda/moe/moe_config.h"
#include "ops/cuda/moe/moe_launch.h"

#if defined(__CUDACC__)
#include "ops/cuda/common/numerics.cuh"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/common/sm90/cp_async.cuh"
#include "ops/cuda/common/sm90/smem.cuh"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/common/sm90/wgmma.cuh"
#endif

namespace dsv4::cuda::moe {

struct GemmArgs {
  const uint8_t* w = nullptr;  // packed weights; expert e at w + e * w_stride
  size_t w_stride = 0;
  const Fp4Epilogue* epi = nullptr;    // [E]
  int n_rows = 0;                      // packed rows (gate/up: 2 * inter)
  int k = 0;                           // reduction length (multiple of 128)
  const __nv_bfloat16* act = nullptr;  // activation rows [*, k]
  const int32_t* act_row = nullptr;    // position -> activation row; null: row = position
  const int4* tiles = nullptr;         // (expert, first position, rows, 0)
  const int32_t* counters = nullptr;   // [1] = number of tiles
  const float* pos_weight = nullptr;   // gate/up: routing weight of each position
  float swiglu_limit = 0;
  __nv_bfloat16* out = nullptr;  // [positions, ldo]
  int ldo = 0;
  // Down GEMM of decode tiles (QUANT_B): `act` is the unquantised SwiGLU output; the CTA
  // FP8-fake-quantises its activation tile in shared memory; the CTAs of row block 0 also
  // store the quantised rows here ([positions, k]).
  __nv_bfloat16* act_q_out = nullptr;
  int max_ctas = 0;  // the persistent grid's cap (MoeArgs::gemm_ctas); 0: none
};

// Decode tiles quantise the down GEMM's activations themselves (no separate launch).
template <class T>
constexpr bool gemm_quantises_b() {
  return T::BN <= 32;
}

template <ExpertFormat F, class T>
constexpr int gemm_stage_bytes() {
  constexpr int b = T::KC * T::BN * 128;
  constexpr int w = T::WGS * T::MT * T::KC * pack_tile_bytes(F);
  return (b + w + 1023) / 1024 * 1024;
}
template <ExpertFormat F, class T>
constexpr int gemm_smem_bytes() {
  return T::STAGES * gemm_stage_bytes<F, T>() + 1024;  // + alignment slack
}
// The largest tile's stages and its static row table (s_src) within the 227 KB a CTA of sm_90
// may opt in to.
static_assert(gemm_smem_bytes<ExpertFormat::kNvfp4, TileN256>() + 256 * sizeof(void*) <= 227 * 1024,
              "TileN256 does not fit shared memory");

#if defined(__CUDACC__)

// a * {s.lo, s.lo} (HI = false) or a * {s.hi, s.hi}: fma.rn.bf16x2 with -0 added, exact for
// e2m1 x scale (ptxas folds the broadcast into the multiply's operand: HMUL2 ... R.H0_H0 /
// R.H1_H1).
template <bool HI>
__device__ __forceinline__ uint32_t bf16x2_mul_half(uint32_t a, uint32_t s) {
  uint32_t d;
  if constexpr (HI)
    asm("{\n\t.reg .b16 lo, hi;\n\t.reg .b32 ss;\n\tmov.b32 {lo, hi}, %2;\n\t"
        "mov.b32 ss, {hi, hi};\n\tfma.rn.bf16x2 %0, %1, ss, %3;\n\t}"
        : "=r"(d)
        : "r"(a), "r"(s), "r"(0x80008000u));
  else
    asm("{\n\t.reg .b16 lo, hi;\n\t.reg .b32 ss;\n\tmov.b32 {lo, hi}, %2;\n\t"
        "mov.b32 ss, {lo, lo};\n\tfma.rn.bf16x2 %0, %1, ss, %3;\n\t}"
        : "=r"(d)
        : "r"(a), "r"(s), "r"(0x80008000u));
  return d;
}

// A fragment of one k16 step: code word -> exact BF16 e2m1 * scale (times 2^-k), each row's
// scale in one half of a two-scale word (fp4_scale_row_pair).
template <bool HI>
__device__ __forceinline__ void dequant_k16_half(uint32_t word, uint32_t s_r0, uint32_t s_r1,
                                                 uint32_t (&a)[4]) {
  uint32_t v[4];
  fp4_word_to_bf16x2(word, v);
  a[0] = bf16x2_mul_half<HI>(v[0], s_r0);
  a[1] = bf16x2_mul_half<HI>(v[1], s_r1);
  a[2] = bf16x2_mul_half<HI>(v[2], s_r0);
  a[3] = bf16x2_mul_half<HI>(v[3], s_r1);
}

// FP8 fake-quantisation, in place, of the 128-wide block j of row r of a stage's activation
// tile (k-blocks 2j, 2j+1; swizzled rows of 128 bytes), by one warp; lane l owns elements
// 4l..4l+3. Returns them (quantised) for the optional global copy.
__device__ __forceinline__ uint2 quant_b_block(uint8_t* st, int b_kb, int r, int j, int lane) {
  const int kb = 2 * j + lane / 16, c = (lane % 16) / 2;
  uint2* p =
      reinterpret_cast<uint2*>(st + kb * b_kb + r * 128 + ((c ^ (r & 7)) << 4) + (lane % 2) * 8);
  const uint2 q = num::fp8_fake_quant_warp128(*p);
  *p = q;
  return q;
}

// One k-block of a stage for one warpgroup: its MT weight tiles' code words and scales (w: the
// first m-tile's tile of this k-block; the next m-tile's is KC tiles on), then 4 / KG wgmma
// groups of width N with B at `desc` (the k-block's activation rows). Group j of the k-block
// dequantises into A buffer (P + j) % 2, P the k-block's parity when a k-block holds an odd number
// of groups (P = 0 otherwise). t: the thread in the warpgroup; rp: its row-pair scale record.
template <ExpertFormat F, class T, int N, int P>
__device__ __forceinline__ void gemm_kblock(const uint8_t* w, uint64_t desc, const Fp4Epilogue& ep,
                                            int t, int rp, uint32_t (&afr)[2][T::KG][T::MT][4],
                                            float (&acc)[T::MT][T::BN / 2]) {
  constexpr int TILE = pack_tile_bytes(F);
  uint4 words[T::MT];
  // BF16 scales of rows r0 (s0) and r1 (s1), two scale groups a word, one per half
  // (fp4_scale_row_pair; dequant_k16_half broadcasts the half): MXFP4's 32-wide groups
  // 0 / 1 for k16 steps 0-1 / 2-3 in the low / high half of s*a; NVFP4's 16-wide groups
  // 0-1 in s*a, 2-3 in s*b (k16 step kk: half kk % 2). Half the instructions of one
  // byte_pair scale per (k16 step, row); the same BF16 values.
  uint32_t s0a[T::MT], s1a[T::MT], s0b[T::MT], s1b[T::MT];
#pragma unroll
  for (int mt = 0; mt < T::MT; ++mt) {
    const uint8_t* tl = w + mt * T::KC * TILE;
    words[mt] = *reinterpret_cast<const uint4*>(tl + 16 * t);
    uint32_t sc_lo, sc_hi = 0;
    if constexpr (F == ExpertFormat::kMxfp4) {
      sc_lo = *reinterpret_cast<const uint32_t*>(tl + kPackCodeBytes + 4 * rp);
    } else {
      const uint2 s2 = *reinterpret_cast<const uint2*>(tl + kPackCodeBytes + 8 * rp);
      sc_lo = s2.x;
      sc_hi = s2.y;
    }
    s0a[mt] = fp4_scale_row_pair<F>(sc_lo, false, ep.a.bias);
    s1a[mt] = fp4_scale_row_pair<F>(sc_lo, true, ep.b.bias);
    s0b[mt] = F == ExpertFormat::kMxfp4 ? 0u : fp4_scale_row_pair<F>(sc_hi, false, ep.a.bias);
    s1b[mt] = F == ExpertFormat::kMxfp4 ? 0u : fp4_scale_row_pair<F>(sc_hi, true, ep.b.bias);
  }
#pragma unroll
  for (int kk0 = 0; kk0 < 4; kk0 += T::KG) {
    const int b = (P + kk0 / T::KG) & 1;  // a constant once unrolled
    // The group that last read afr[b] (two groups back) must retire before afr[b] is
    // rewritten: wait until at most the previous group is in flight, and keep afr[b]'s
    // old values (so their registers) live up to that wait.
    sm90::warpgroup_wait<1>();
#pragma unroll
    for (int kq = 0; kq < T::KG; ++kq)
#pragma unroll
      for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) sm90::warpgroup_fence_operand(afr[b][kq][mt][i]);
#pragma unroll
    for (int kq = 0; kq < T::KG; ++kq)
#pragma unroll
      for (int mt = 0; mt < T::MT; ++mt) {
        const int kk = kk0 + kq;  // a constant once unrolled
        const bool mx = F == ExpertFormat::kMxfp4;
        const uint32_t s0 = mx || kk < 2 ? s0a[mt] : s0b[mt];
        const uint32_t s1 = mx || kk < 2 ? s1a[mt] : s1b[mt];
        const bool hi = mx ? kk >= 2 : kk % 2 == 1;
        const uint32_t word = kk == 0   ? words[mt].x
                              : kk == 1 ? words[mt].y
                              : kk == 2 ? words[mt].z
                                        : words[mt].w;
        if (hi)
          dequant_k16_half<true>(word, s0, s1, afr[b][kq][mt]);
        else
          dequant_k16_half<false>(word, s0, s1, afr[b][kq][mt]);
      }
    sm90::warpgroup_arrive();
#pragma unroll
    for (int kq = 0; kq < T::KG; ++kq)
#pragma unroll
      for (int mt = 0; mt < T::MT; ++mt)
        sm90::Bf16MmaRS<N>::wgmma(afr[b][kq][mt], desc + uint64_t(2 * (kk0 + kq)), acc[mt], true);
    sm90::warpgroup_commit_batch();
  }
}

// The epilogue of a warpgroup's MT m-tiles (the first is 64-row block rb64_0 of the projection):
// gate/up (interleaved w1/w3 rows): a = bf16(w_pos * silu(min(g, L)) * clamp(u, -L, L)) with g, u
// the BF16-rounded projections; down: BF16 of the projection. Accumulator i of m-tile mt: row
// 16*warp + lane/4 (+8 for i%4 >= 2) of the m-tile's 64 rows, token column 8*(i/4) + 2*(lane%4)
// + i%2; columns past the tile's rows are not stored.
template <class T, bool GATE_UP>
__device__ __forceinline__ void gemm_epilogue(const GemmArgs& a, const Fp4Epilogue& ep,
                                              const float (&acc)[T::MT][T::BN / 2], int rb64_0,
                                              int warp, int lane, int first, int rows) {
#pragma unroll
  for (int mt = 0; mt < T::MT; ++mt) {
    const int rb64 = rb64_0 + mt;
#pragma unroll
    for (int j = 0; j < T::BN / 8; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int col = 8 * j + 2 * (lane % 4) + q;
        if (col >= rows) continue;
        const int pos = first + col;
        const float d0 = acc[mt][4 * j + q], d1 = acc[mt][4 * j + 2 + q];
        if constexpr (GATE_UP) {
          const int i = rb64 * 32 + 8 * warp + lane / 4;  // intermediate index
          float g = num::bf16r(__fmul_rn(d0, ep.a.mult));
          float u = num::bf16r(__fmul_rn(d1, ep.b.mult));
          const float lim = a.swiglu_limit;
          if (lim > 0) {  // std::clamp / std::min, NaN passing through as on the CPU
            u = u < -lim ? -lim : (lim < u ? lim : u);
            g = lim < g ? lim : g;
          }
          float v = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
          v = __fmul_rn(a.pos_weight[pos], v);
          a.out[size_t(pos) * a.ldo + i] = __float2bfloat16_rn(v);
        } else {
          const int n = rb64 * 64 + 16 * warp + lane / 4;
          a.out[size_t(pos) * a.ldo + n] = __float2bfloat16_rn(__fmul_rn(d0, ep.a.mult));
          a.out[size_t(pos) * a.ldo + n + 8] = __float2bfloat16_rn(__fmul_rn(d1, ep.b.mult));
        }
      }
  }
}

// Calls f(std::integral_constant<int, N>) for the MMA width a tile of `rows` tokens needs: from
// BN 64 on, the quarter of BN that covers them (BN/4 .. BN: the accumulators of the unused
// columns idle); smaller tiles always BN. N is a template argument: a width chosen by a branch
// inside the mainloop makes ptxas serialise every wgmma with the next dequantisation.
template <int BN, class F>
__device__ __forceinline__ void for_mma_width(int rows, F&& f) {
  if constexpr (BN >= 64) {
    switch (min(4, (4 * rows + BN - 1) / BN)) {
      case 1:
        return f(std::integral_constant<int, BN / 4>{});
      case 2:
        return f(std::integral_constant<int, BN / 2>{});
      case 3:
        return f(std::integral_constant<int, 3 * BN / 4>{});
      default:
        return f(std::integral_constant<int, BN>{});
    }
  } else {
    return f(std::integral_constant<int, BN>{});
  }
}

template <ExpertFormat F, class T, bool GATE_UP>
__global__ void __launch_bounds__(T::THREADS) moe_gemm_kernel(const GemmArgs a) {
  constexpr int TILE = pack_tile_bytes(F);
  constexpr int B_KB = T::BN * 128;  // one k-block of BN activation rows: one swizzle atom column
  constexpr int B_BYTES = T::KC * B_KB;
  constexpr int STAGE = gemm_stage_bytes<F, T>();
  constexpr int NACC = T::BN / 2;
  // The copy plan of the activation tile, the same for every stage of an item: thread tid
  // copies 16-byte chunk c = tid % 8 of tile rows rr + q * RPP (q < QN; every k-block) when the
  // threads cover at most BN rows at a time, else of row rr in every KSTEP-th k-block from
  // kfirst. Rows differ by multiples of 8 within a thread, so its swizzled column is fixed.
  // (The per-copy index arithmetic of a generic loop cost ~40 instructions a copy: 42 % of the
  // kernel's instructions at 4096 tokens, an issue-bound kernel -- H200 Nsight, session 38.)
  constexpr int RPP = T::THREADS / 8;
  constexpr int QN = RPP <= T::BN ? T::BN / RPP : 1;
  constexpr int KSTEP = RPP <= T::BN ? 1 : RPP / T::BN;
  static_assert(T::BN % RPP == 0 || RPP % T::BN == 0, "activation copy plan");
  static_assert(T::KC % KSTEP == 0 && RPP % 8 == 0, "activation copy plan");
  static_assert(T::BN <= T::THREADS, "one thread sets each tile row's source (s_src)");
  // Weight copies: W_TOTAL 16-byte chunks a stage, in W_PASSES passes over the CTA's threads.
  constexpr int CH_PER_SET = T::KC * TILE / 16;  // 16-byte chunks per (warpgroup, m-tile)
  constexpr int W_TOTAL = T::WGS * T::MT * CH_PER_SET;
  constexpr int W_PASSES = (W_TOTAL + T::THREADS - 1) / T::THREADS;
  static_assert(TILE % 16 == 0, "weight tiles in 16-byte chunks");
  extern __shared__ uint8_t smem_raw[];
  // Where each tile row's activations start (position -> activation row), null past the
  // tile's rows; set once per item.
  __shared__ const __nv_bfloat16* s_src[T::BN];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t smem32 = sm90::smem_u32(smem);

  sm90::griddep_wait();
  sm90::griddep_launch_dependents();

  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128, warp = t / 32, lane = t % 32;
  const int KB = a.k / 64;
  const int nch = (KB + T::KC - 1) / T::KC;
  const int row_blocks = a.n_rows / T::BM;
  const int total = a.counters[1] * row_blocks;
  const int rp = 8 * warp + lane / 4;  // this thread's row-pair scale record
  // A fragments in two buffers that alternate between consecutive wgmma groups. The registers
  // of an in-flight wgmma's A operand must not be written before a wait retires it (PTX: undefined;
  // ptxas neither serialises nor warns): with one buffer, the dequantisation of the next group
  // -- or the shared-memory load of its code words -- overwrote the A operand of the group
  // still running (H200 run 1: decode-tile GEMMs off by up to 20 %, NaNs at real sizes).
  uint32_t afr[2][T::KG][T::MT][4];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int kq = 0; kq < T::KG; ++kq)
#pragma unroll
      for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) afr[b][kq][mt][i] = 0u;

  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const int4 tile = a.tiles[item / row_blocks];
    const int rbc = item % row_blocks;
    const int e = tile.x, first = tile.y, rows = tile.z;
    const Fp4Epilogue ep = a.epi[e];
    const uint8_t* wbase =
        a.w + size_t(e) * a.w_stride + size_t(rbc) * (T::WGS * T::MT) * KB * TILE;

    __syncthreads();  // the previous item is done with shared memory
    if (tid < T::BN)
      s_src[tid] = tid < rows
                       ? a.act + size_t(a.act_row ? a.act_row[first + tid] : first + tid) * a.k
                       : nullptr;
    __syncthreads();

    auto load_chunk = [&](int ch) {
      if (ch < nch) {
        const uint32_t st = smem32 + (ch % T::STAGES) * STAGE;
        const int kb0 = ch * T::KC;
        const int nk = min(T::KC, KB - kb0);
        const int c = tid % 8, rr = (tid / 8) % T::BN;
        const int kfirst = RPP <= T::BN ? 0 : (tid / 8) / T::BN;
        const uint32_t dst0 = st + rr * 128 + ((c ^ (rr & 7)) << 4);
#pragma unroll
        for (int q = 0; q < QN; ++q) {
          // Rows past the tile's tokens are not loaded: an MMA column depends only on its
          // own B column, and those columns are never stored.
          const __nv_bfloat16* src = s_src[rr + q * RPP];
          if (src == nullptr) continue;
          src += size_t(kb0) * 64 + c * 8;
#pragma unroll
          for (int kj = 0; kj < T::KC / KSTEP; ++kj) {
            const int kbl = kfirst + kj * KSTEP;
            if (kbl < nk) sm90::cp_async_16(dst0 + kbl * B_KB + q * RPP * 128, src + kbl * 64);
          }
        }
        const uint8_t* wsrc = wbase + size_t(kb0) * TILE;
#pragma unroll
        for (int n = 0; n < W_PASSES; ++n) {
          const int i = tid + n * T::THREADS;
          if (W_TOTAL % T::THREADS != 0 && i >= W_TOTAL) break;
          const int gm = i / CH_PER_SET, j = i - gm * CH_PER_SET;
          if (j * 16 < nk * TILE)
            sm90::cp_async_16(st + B_BYTES + gm * (T::KC * TILE) + j * 16,
                              wsrc + size_t(gm) * KB * TILE + j * 16);
        }
      }
      sm90::cp_async_commit();
    };

    float acc[T::MT][NACC];
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[mt][i] = 0.0f;

#pragma unroll
    for (int s = 0; s < T::STAGES - 2; ++s) load_chunk(s);

    // The mainloop for one MMA width N (for_mma_width).
    auto mainloop = [&](auto width) {
      constexpr int N = decltype(width)::value;
#pragma unroll 1
      for (int ch = 0; ch < nch; ++ch) {
        // Stage ch-2 (refilled below) is free once this warpgroup's MMAs on it are done and
        // every thread has passed this point.
        sm90::warpgroup_wait<1>();
        sm90::cp_async_wait<T::STAGES - 3>();
        sm90::fence_proxy_async_smem();
        __syncthreads();
        load_chunk(ch + T::STAGES - 2);

        uint8_t* st = smem + (ch % T::STAGES) * STAGE;
        const int nk = min(T::KC, KB - ch * T::KC);
        if constexpr (!GATE_UP && gemm_quantises_b<T>()) {
          // The 128-wide blocks of this stage's rows, one warp each; then to the tensor cores.
          const int blocks = nk / 2;
          for (int task = tid / 32; task < rows * blocks; task += T::THREADS / 32) {
            const int r = task / blocks, j = task % blocks;
            const uint2 q = quant_b_block(st, B_KB, r, j, lane);
            if (rbc == 0 && a.act_q_out)
              *reinterpret_cast<uint2*>(a.act_q_out + size_t(first + r) * a.k +
                                        (ch * T::KC + 2 * j) * 64 + 4 * lane) = q;
          }
          sm90::fence_proxy_async_smem();
          __syncthreads();
        }
        auto kblock = [&](int kbl, auto parity) {
          gemm_kblock<F, T, N, decltype(parity)::value>(
              st + B_BYTES + (wg * T::MT * T::KC + kbl) * TILE,
              sm90::desc_k_sw128(sm90::smem_u32(st + kbl * B_KB)), ep, t, rp, afr, acc);
        };
        // nk is even (K % 128 == 0, KC even), so the parity pattern repeats every two k-blocks
        // and every chunk starts on buffer 0.
        if constexpr ((4 / T::KG) % 2 == 0) {
#pragma unroll 1
          for (int kbl = 0; kbl < nk; ++kbl) kblock(kbl, std::integral_constant<int, 0>{});
        } else {
#pragma unroll 1
          for (int kbl = 0; kbl < nk; kbl += 2) {
            kblock(kbl, std::integral_constant<int, 0>{});
            kblock(kbl + 1, std::integral_constant<int, 1>{});
          }
        }
      }
      // Drain before the paths of the width dispatch below merge (register moves there must
      // not touch accumulators of an in-flight wgmma).
      sm90::warpgroup_wait<0>();
#pragma unroll
      for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int i = 0; i < NACC; ++i) sm90::warpgroup_fence_operand(acc[mt][i]);
    };
    // Prefill tiles run the MMA on the quarters of BN the tile's rows need (N = BN/4 .. BN; the
    // accumulators of the unused columns idle).
    for_mma_width<T::BN>(rows, mainloop);

    gemm_epilogue<T, GATE_UP>(a, ep, acc, rbc * (T::WGS * T::MT) + wg * T::MT, warp, lane, first,
                              rows);
  }
}

// Launches one persistent expert-GEMM instance: its opt-in shared memory and its grid (resident
// CTAs per SM x SMs) are set up once per instance and device; GemmArgs::max_ctas caps the grid.
// `what` names the kernel family in the error when no CTA fits.
template <auto kKernel>
void launch_persistent_gemm(int threads, int smem, const char* what, int tile_n, const GemmArgs& a,
                            const LaunchCtx& c) {
  static std::atomic<int> grids[kMaxDevices] = {};
  const int dev = current_device();
  int grid = grids[dev].load(std::memory_order_acquire);
  if (grid == 0) {
    DSV4_CUDA_CHECK(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int per_sm = 0;
    DSV4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, smem));
    DSV4_CHECK(per_sm > 0, what, " (tile_n ", tile_n, "): no CTA fits on an SM (", smem,
               " bytes of shared memory)");
    grid = per_sm * sm_count();
    grids[dev].store(grid, std::memory_order_release);
  }
  if (a.max_ctas > 0) grid = std::min(grid, a.max_ctas);
  launch_kernel(c, kKernel, dim3(grid), dim3(threads), size_t(smem), a);
}

template <ExpertFormat F, class T, bool GATE_UP>
void launch_moe_gemm_instance(const GemmArgs& a, const LaunchCtx& c) {
  launch_persistent_gemm<moe_gemm_kernel<F, T, GATE_UP>>(T::THREADS, gemm_smem_bytes<F, T>(),
                                                         "moe expert GEMM", T::BN, a, c);
}

template <ExpertFormat F>
void launch_moe_gemm_impl(int tile_n, bool gate_up, const GemmArgs& a, const LaunchCtx& c) {
  switch (tile_n) {
    case 8:
      return gate_up ? launch_moe_gemm_instance<F, TileN8, true>(a, c)
                     : launch_moe_gemm_instance<F, TileN8, false>(a, c);
    case 32:
      return gate_up ? launch_moe_gemm_instance<F, TileN32, true>(a, c)
                     : launch_moe_gemm_instance<F, TileN32, false>(a, c);
    case 64:
      return gate_up ? launch_moe_gemm_instance<F, TileN64, true>(a, c)
                     : launch_moe_gemm_instance<F, TileN64, false>(a, c);
    case 128:
      return gate_up ? launch_moe_gemm_instance<F, TileN128, true>(a, c)
                     : launch_moe_gemm_instance<F, TileN128, false>(a, c);
    case 256:
      return gate_up ? launch_moe_gemm_instance<F, TileN256, true>(a, c)
                     : launch_moe_gemm_instance<F, TileN256, false>(a, c);
    default:
      throw Error(cat("moe expert GEMM: unsupported token tile ", tile_n));
  }
}

#endif  // __CUDACC__

// Host launchers (moe_gemm_mxfp4.cu / moe_gemm_nvfp4.cu): tile_n in {8, 32, 64, 128, 256}.
void launch_moe_gemm_mxfp4(int tile_n, bool gate_up, const GemmArgs& a, const LaunchCtx& c);
void launch_moe_gemm_nvfp4(int tile_n, bool gate_up, const GemmArgs& a, const LaunchCtx& c);

// Weight rows per CTA tile of a token tile size.
int gemm_tile_rows(int tile_n);

}  // namespace dsv4::cuda::moe
