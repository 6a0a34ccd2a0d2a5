// Decode-path grouped FP4 expert GEMM (W4A16, as moe_gemm.cuh computes it), warp-specialised
// so that the weight stream never stops (moe_config.h, StreamTile):
//  * one persistent CTA per SM over (token tile, 64-row weight block) items, item = blockIdx.x
//    + j * gridDim.x; the STAGES-deep ring of mbarrier-guarded stages persists across items;
//  * the producer warp fills a stage with one bulk copy (cp.async.bulk, the copy engine) of the
//    KC packed weight tiles -- a 64-row block's K stream is contiguous (fp4_pack.h) -- and,
//    lane-parallel, cp.async of the tile's activation rows (gathered by position, 128-byte
//    swizzle), whose completion the same full barrier tracks (cp.async.mbarrier.arrive);
//  * consumer warpgroup w takes k-blocks 2w, 2w+1 of every stage (one 128-wide block, so the
//    down GEMM's FP8 fake-quantisation of that block stays inside one warpgroup), dequantises
//    the FP4 words in registers to BF16 A fragments (exact, fp4_pack.h) and issues m64nBNk16
//    wgmmas with B from shared memory; each warp releases a stage on its empty barrier one
//    stage later, once the next stage's wait has retired its wgmmas (no drain per stage);
//  * at the end of an item the other warpgroups hand their fp32 partial sums to warpgroup 0
//    through shared memory (same fragment layout, one fp32 add each), which runs the epilogue of
//    moe_gemm.cuh: SwiGLU + routing weight (gate/up) or the BF16 projection (down).
// Numerics: the products are those of moe_gemm.cuh (exact BF16 e2m1 x scale times the
// FP8-fake-quantised activations); only the fp32 summation order differs (one partial sum per
// consumer warpgroup).
#pragma once

#include "ops/cuda/moe/moe_gemm.cuh"

#if defined(__CUDACC__)
#include "ops/cuda/common/sm90/mbarrier.cuh"
#include "ops/cuda/common/sm90/tma.cuh"
#endif

namespace dsv4::cuda::moe {

template <ExpertFormat F, class T>
constexpr int stream_stage_bytes() {
  constexpr int b = T::KC * T::BN * 128;
  constexpr int w = T::KC * pack_tile_bytes(F);
  return (b + w + 1023) / 1024 * 1024;
}
template <ExpertFormat F, class T>
constexpr int stream_smem_bytes() {
  return T::STAGES * stream_stage_bytes<F, T>() + 1024;  // + alignment slack
}

#if defined(__CUDACC__)

// QUANT_B (down GEMM only): the CTA FP8-fake-quantises its activation tile in shared memory
// (GemmArgs::act unquantised); otherwise `act` holds the quantised rows already.
template <ExpertFormat F, class T, bool GATE_UP, bool QUANT_B>
__global__ void __launch_bounds__(T::THREADS, 1) moe_gemm_stream_kernel(const GemmArgs a) {
  static_assert(!(GATE_UP && QUANT_B), "only the down GEMM quantises its activations");
  constexpr int TILE = pack_tile_bytes(F);
  constexpr int B_KB = T::BN * 128;  // one k-block of BN activation rows
  constexpr int B_BYTES = T::KC * B_KB;
  constexpr int STAGE = stream_stage_bytes<F, T>();
  constexpr int NACC = T::BN / 2;
  constexpr int CONSUMER_THREADS = 128 * T::CONSUMERS;
  static_assert(T::KC == 2 * T::CONSUMERS, "one 128 block per consumer");
  constexpr int kRedBarrier = 1 + T::CONSUMERS;  // named barriers 1..CONSUMERS: quantisation
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[T::STAGES];
  __shared__ __align__(8) uint64_t empty_bar[T::STAGES];
  // The partial sums of warpgroups 1.. (by item parity; at least one slot for C = 1).
  __shared__ float red[2][T::CONSUMERS > 1 ? T::CONSUMERS - 1 : 1][128 * NACC];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_u32(smem_raw) & 1023)) & 1023);

  const int tid = threadIdx.x;
  if (tid == 0) {
#pragma unroll 1
    for (int s = 0; s < T::STAGES; ++s) {
      // full: the producer's arrive.expect_tx + one cp.async arrival per producer lane;
      // empty: one arrival per consumer warp.
      sm90::mbar_init(&full_bar[s], 1 + 32);
      sm90::mbar_init(&empty_bar[s], CONSUMER_THREADS / 32);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  sm90::griddep_wait();
  sm90::griddep_launch_dependents();

  const int KB = a.k / 64;
  const int nch = (KB + T::KC - 1) / T::KC;
  const int row_blocks = a.n_rows / T::BM;
  const int total = a.counters[1] * row_blocks;

  if (tid >= CONSUMER_THREADS) {
    // ---- producer warp ----
    // Lane l copies 16-byte chunk c = l % 8 of tile rows l / 8, l / 8 + 4, ...: its source
    // rows and swizzled destinations are computed once per item, so a stage costs one add
    // and one cp.async per (k-block, row) (the per-copy index arithmetic was the warp's
    // bottleneck at a few rows per tile: consumers waited on full stages, H200 Nsight).
    constexpr int RPL = (T::BN + 3) / 4;  // tile rows per lane
    const int lane = tid % 32, c = lane % 8, r0 = lane / 8;
    uint32_t g = 0;  // stages filled so far (the consumers count the same sequence)
#pragma unroll 1
    for (int item = blockIdx.x; item < total; item += gridDim.x) {
      const int4 tile = a.tiles[item / row_blocks];
      const int rb = item % row_blocks;
      const int first = tile.y, rows = tile.z;
      const __nv_bfloat16* src[RPL];
      uint32_t dst[RPL];
#pragma unroll
      for (int j = 0; j < RPL; ++j) {
        const int r = r0 + 4 * j;
        const int row = r < rows ? (a.act_row ? a.act_row[first + r] : first + r) : 0;
        src[j] = a.act + size_t(row) * a.k + c * 8;
        dst[j] = uint32_t(r * 128 + ((c ^ (r & 7)) << 4));
      }
      const uint8_t* wsrc = a.w + size_t(tile.x) * a.w_stride + size_t(rb) * KB * TILE;
#pragma unroll 1
      for (int ch = 0; ch < nch; ++ch, ++g) {
        const int s = int(g % T::STAGES);
        sm90::mbar_wait(&empty_bar[s], ((g / T::STAGES) & 1u) ^ 1u);
        uint8_t* st = smem + s * STAGE;
        const uint32_t st32 = sm90::smem_u32(st);
        const int kb0 = ch * T::KC, nk = min(T::KC, KB - kb0);
        if (lane == 0) {
          const uint32_t bytes = uint32_t(nk * TILE);
          sm90::mbar_arrive_expect_tx(&full_bar[s], bytes);
          sm90::bulk_load(st + B_BYTES, wsrc + size_t(kb0) * TILE, bytes, &full_bar[s],
                          sm90::kEvictFirst);
        }
        // Rows past the tile's tokens are not loaded: an MMA column depends only on its own B
        // column, and those columns are never stored.
#pragma unroll
        for (int kbl = 0; kbl < T::KC; ++kbl) {
          if (kbl >= nk) break;
#pragma unroll
          for (int j = 0; j < RPL; ++j)
            if (r0 + 4 * j < rows)
              sm90::cp_async_16(st32 + kbl * B_KB + dst[j], src[j] + (kb0 + kbl) * 64);
        }
        sm90::cp_async_mbar_arrive_noinc(&full_bar[s]);
      }
    }
    // Tail: the warp leaves only once the consumers have released every stage, i.e. after all
    // of its copies have landed and been read (none still in flight at its exit).
#pragma unroll 1
    for (int i = 0; i < T::STAGES; ++i, ++g)
      sm90::mbar_wait(&empty_bar[g % T::STAGES], ((g / T::STAGES) & 1u) ^ 1u);
    return;
  }

  // ---- consumer warpgroups ----
  // The warpgroup index through a broadcast, so the compiler keeps it (and the wgmma
  // descriptors built from it) in uniform registers: no R2UR per wgmma.
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int t = tid % 128, warp = t / 32, lane = t % 32;
  const int rp = 8 * warp + lane / 4;  // this thread's row-pair scale record
  // A fragments in two buffers, alternating between the two k-blocks of a stage (the registers
  // of an in-flight wgmma's A operand must not be rewritten before a wait retires it).
  uint32_t afr[2][4][4];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) afr[b][kk][i] = 0u;

  uint32_t g = 0;
  int local = 0;
#pragma unroll 1
  for (int item = blockIdx.x; item < total; item += gridDim.x, ++local) {
    const int4 tile = a.tiles[item / row_blocks];
    const int rb = item % row_blocks;
    const int e = tile.x, first = tile.y, rows = tile.z;
    const Fp4Epilogue ep = a.epi[e];

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.0f;

    // One k-block of the stage into A buffer B: its weight words and scales, 4 wgmmas.
    auto kblock = [&](const uint8_t* st, int kbl, auto buf) {
      constexpr int B = decltype(buf)::value;
      const uint8_t* tl = st + B_BYTES + kbl * TILE;
      const uint4 words = *reinterpret_cast<const uint4*>(tl + 16 * t);
      uint32_t sc_lo, sc_hi;
      if constexpr (F == ExpertFormat::kMxfp4) {
        sc_lo = *reinterpret_cast<const uint32_t*>(tl + kPackCodeBytes + 4 * rp);
        sc_hi = 0;
      } else {
        const uint2 s2 = *reinterpret_cast<const uint2*>(tl + kPackCodeBytes + 8 * rp);
        sc_lo = s2.x;
        sc_hi = s2.y;
      }
      const uint64_t desc = sm90::desc_k_sw128(sm90::smem_u32(st + kbl * B_KB));
      // The group that last read afr[B] must have retired (at most the other buffer's group
      // stays in flight), and afr[B]'s old values stay live up to that wait.
      sm90::warpgroup_wait<1>();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) sm90::warpgroup_fence_operand(afr[B][kk][i]);
      // Scales of rows r0 and r1, two groups a word (fp4_scale_row_pair): MXFP4's 32-wide
      // groups 0 / 1 for k16 steps 0-1 / 2-3 (low / high half), NVFP4's 16-wide groups 0-1 in
      // sc_lo and 2-3 in sc_hi (k16 step kk: half kk % 2).
      const uint32_t s0a = fp4_scale_row_pair<F>(sc_lo, false, ep.a.bias);
      const uint32_t s1a = fp4_scale_row_pair<F>(sc_lo, true, ep.b.bias);
      if constexpr (F == ExpertFormat::kMxfp4) {
        dequant_k16_half<false>(words.x, s0a, s1a, afr[B][0]);
        dequant_k16_half<false>(words.y, s0a, s1a, afr[B][1]);
        dequant_k16_half<true>(words.z, s0a, s1a, afr[B][2]);
        dequant_k16_half<true>(words.w, s0a, s1a, afr[B][3]);
      } else {
        const uint32_t s0b = fp4_scale_row_pair<F>(sc_hi, false, ep.a.bias);
        const uint32_t s1b = fp4_scale_row_pair<F>(sc_hi, true, ep.b.bias);
        dequant_k16_half<false>(words.x, s0a, s1a, afr[B][0]);
        dequant_k16_half<true>(words.y, s0a, s1a, afr[B][1]);
        dequant_k16_half<false>(words.z, s0b, s1b, afr[B][2]);
        dequant_k16_half<true>(words.w, s0b, s1b, afr[B][3]);
      }
      sm90::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        sm90::Bf16MmaRS<T::BN>::wgmma(afr[B][kk], desc + uint64_t(2 * kk), acc, true);
      sm90::warpgroup_commit_batch();
    };

    // A stage is released once its wgmmas have retired, which the next stage's second wait
    // proves (at most one group -- that stage's first -- still in flight), so the MMAs of one
    // stage overlap the dequantisation of the next instead of draining every stage.
    auto release = [&](int s) {
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(&empty_bar[s]);
    };
    int pending = -1;  // stage read by wgmmas that may still be in flight
#pragma unroll 1
    for (int ch = 0; ch < nch; ++ch, ++g) {
      const int s = int(g % T::STAGES);
      sm90::mbar_wait(&full_bar[s], (g / T::STAGES) & 1u);
      uint8_t* st = smem + s * STAGE;
      const int nk = min(T::KC, KB - ch * T::KC);  // even: K % 128 == 0
      const int kb = 2 * wg;                       // this warpgroup's 128-wide block
      if (kb < nk) {                               // uniform over the warpgroup
        if constexpr (QUANT_B) {
          // FP8 fake-quantisation of the block's rows in place (a warp per row), then to the
          // tensor cores; the CTAs of row block 0 also store the quantised rows.
#pragma unroll 1
          for (int r = warp; r < rows; r += 4) {
            const uint2 q = quant_b_block(st, B_KB, r, wg, lane);
            if (rb == 0 && a.act_q_out)
              *reinterpret_cast<uint2*>(a.act_q_out + size_t(first + r) * a.k +
                                        (ch * T::KC + kb) * 64 + 4 * lane) = q;
          }
        }
        // The activations (cp.async, or the stores above) are read next by the async proxy.
        sm90::fence_proxy_async_smem();
        if constexpr (QUANT_B) sm90::named_barrier_sync(1 + wg, 128);
        kblock(st, kb, std::integral_constant<int, 0>{});
        kblock(st, kb + 1, std::integral_constant<int, 1>{});  // its wait retired stage `pending`
        if (pending >= 0) release(pending);
        pending = s;
      } else {
        sm90::warpgroup_wait<0>();
        if (pending >= 0) release(pending);
        pending = -1;
        release(s);
      }
    }
    sm90::warpgroup_wait<0>();
#pragma unroll
    for (int i = 0; i < NACC; ++i) sm90::warpgroup_fence_operand(acc[i]);
    if (pending >= 0) release(pending);

    // The other warpgroups' partial sums to warpgroup 0 (double-buffered by item parity: a
    // warpgroup rewrites a buffer only after passing the next item's barrier, which warpgroup
    // 0 reaches after reading it).
    if constexpr (T::CONSUMERS > 1) {
      if (wg > 0) {
        float* rd = red[local & 1][wg - 1];
#pragma unroll
        for (int i = 0; i < NACC; ++i) rd[i * 128 + t] = acc[i];
      }
      sm90::named_barrier_sync(kRedBarrier, CONSUMER_THREADS);
      if (wg > 0) continue;
#pragma unroll 1
      for (int w = 0; w < T::CONSUMERS - 1; ++w) {
        const float* rd = red[local & 1][w];
#pragma unroll
        for (int i = 0; i < NACC; ++i) acc[i] += rd[i * 128 + t];
      }
    }

    // Epilogue (moe_gemm.cuh, one m-tile). Accumulator i: row 16*warp + lane/4 (+8 for
    // i%4 >= 2) of the item's 64 rows, token column 8*(i/4) + 2*(lane%4) + i%2.
#pragma unroll
    for (int j = 0; j < T::BN / 8; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int col = 8 * j + 2 * (lane % 4) + q;
        if (col >= rows) continue;
        const int pos = first + col;
        const float d0 = acc[4 * j + q], d1 = acc[4 * j + 2 + q];
        if constexpr (GATE_UP) {
          const int i = rb * 32 + 8 * warp + lane / 4;  // intermediate index
          float gv = num::bf16r(__fmul_rn(d0, ep.a.mult));
          float u = num::bf16r(__fmul_rn(d1, ep.b.mult));
          const float lim = a.swiglu_limit;
          if (lim > 0) {  // std::clamp / std::min, NaN passing through as on the CPU
            u = u < -lim ? -lim : (lim < u ? lim : u);
            gv = lim < gv ? lim : gv;
          }
          float v = __fmul_rn(__fdiv_rn(gv, __fadd_rn(1.0f, expf(-gv))), u);
          v = __fmul_rn(a.pos_weight[pos], v);
          a.out[size_t(pos) * a.ldo + i] = __float2bfloat16_rn(v);
        } else {
          const int n = rb * 64 + 16 * warp + lane / 4;
          a.out[size_t(pos) * a.ldo + n] = __float2bfloat16_rn(__fmul_rn(d0, ep.a.mult));
          a.out[size_t(pos) * a.ldo + n + 8] = __float2bfloat16_rn(__fmul_rn(d1, ep.b.mult));
        }
      }
  }
}

// One kernel instance; one CTA per SM (the grid is computed once per instance and device).
template <ExpertFormat F, class T, bool GATE_UP, bool QUANT_B>
void launch_moe_gemm_stream_instance(const GemmArgs& a, const LaunchCtx& c) {
  launch_persistent_gemm<moe_gemm_stream_kernel<F, T, GATE_UP, QUANT_B>>(
      T::THREADS, stream_smem_bytes<F, T>(), "moe stream expert GEMM", T::BN, a, c);
}

// gate_up: the gate/up GEMM (quant_b must be false); else the down GEMM, quantising its
// activations itself when quant_b.
template <ExpertFormat F, class T>
void launch_moe_gemm_stream_tile(bool gate_up, bool quant_b, const GemmArgs& a,
                                 const LaunchCtx& c) {
  if (gate_up) {
    DSV4_CHECK(!quant_b, "moe stream expert GEMM: the gate/up GEMM does not quantise");
    return launch_moe_gemm_stream_instance<F, T, true, false>(a, c);
  }
  return quant_b ? launch_moe_gemm_stream_instance<F, T, false, true>(a, c)
                 : launch_moe_gemm_stream_instance<F, T, false, false>(a, c);
}

template <ExpertFormat F>
void launch_moe_gemm_stream_impl(int tile_n, bool gate_up, bool quant_b, const GemmArgs& a,
                                 const LaunchCtx& c) {
  switch (tile_n) {
    case 8:
      return launch_moe_gemm_stream_tile<F, StreamN8>(gate_up, quant_b, a, c);
    case 16:
      return launch_moe_gemm_stream_tile<F, StreamN16>(gate_up, quant_b, a, c);
    default:
      throw Error(cat("moe stream expert GEMM: unsupported token tile ", tile_n));
  }
}

#endif  // __CUDACC__

// Host launchers (moe_gemm_stream_{mxfp4,nvfp4}.cu): tile_n in {8, 16}; n_rows % 64 == 0,
// k % 128 == 0; quant_b: the down GEMM quantises its activations (GemmArgs::act unquantised).
void launch_moe_gemm_stream_mxfp4(int tile_n, bool gate_up, bool quant_b, const GemmArgs& a,
                                  const LaunchCtx& c);
void launch_moe_gemm_stream_nvfp4(int tile_n, bool gate_up, bool quant_b, const GemmArgs& a,
                                  const LaunchCtx& c);

}  // namespace dsv4::cuda::moe
