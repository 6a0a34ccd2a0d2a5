// Prefill-path grouped FP4 expert GEMM, warp-specialised: moe_gemm.cuh's tile, mainloop
// (gemm_kblock) and epilogue (gemm_epilogue), fed by a producer warpgroup through a ring of
// mbarrier-guarded stages that persists across work items:
//  * one persistent CTA per SM over the (token tile, weight-row block) items in moe_gemm.cuh's
//    order (item = blockIdx.x + j * gridDim.x);
//  * the producer warpgroup fills a stage with one bulk copy (cp.async.bulk) of each m64 tile's KC
//    packed weight tiles (a 64-row block's K stream is contiguous, fp4_pack.h) and, in parallel,
//    cp.async of the tile's activation rows (gathered by position, 128-byte swizzle) whose
//    completion the same full barrier tracks (cp.async.mbarrier.arrive); it runs on into the next
//    item while the consumers finish this one: no pipeline drain or refill at item boundaries and
//    no CTA-wide barrier per stage (moe_gemm.cuh's kernel has both);
//  * consumer warpgroup w computes m-tiles w * MT .. w * MT + MT - 1 at the MMA width the item's
//    rows need (quarters of BN), releasing a stage on its empty barrier once the next stage's
//    first k-block has retired its wgmmas.
// Same products in the same order as moe_gemm.cuh's kernel with the same tile: bit-identical
// outputs. Registers: the producer warpgroup gives its share to the consumers (setmaxnreg,
// kWsProducerRegs / kWsConsumerRegs): TileN128's consumers hold 128 accumulators and two m-tiles'
// A fragments (252 registers in moe_gemm.cuh's kernel).
#pragma once

#include "ops/cuda/moe/moe_gemm.cuh"

#if defined(__CUDACC__)
#include "ops/cuda/common/sm90/mbarrier.cuh"
#include "ops/cuda/common/sm90/tma.cuh"
#endif

namespace dsv4::cuda::moe {

#if defined(__CUDACC__)

// setmaxnreg budgets: 128 x (40 + 2 x 232) <= 64K.
constexpr int kWsProducerRegs = 40, kWsConsumerRegs = 232;
constexpr int kWsProducerThreads = 128;

template <ExpertFormat F, class T, bool GATE_UP>
__global__ void __launch_bounds__(T::THREADS + kWsProducerThreads, 1)
    moe_gemm_ws_kernel(const GemmArgs a) {
  constexpr int TILE = pack_tile_bytes(F);
  constexpr int B_KB = T::BN * 128;  // one k-block of BN activation rows
  constexpr int B_BYTES = T::KC * B_KB;
  constexpr int STAGE = gemm_stage_bytes<F, T>();
  constexpr int NACC = T::BN / 2;
  constexpr int MTILES = T::WGS * T::MT;         // m64 tiles per item
  constexpr int RSTEP = kWsProducerThreads / 8;  // tile rows a copy pass covers
  static_assert(T::WGS == 2 && 128 * (kWsProducerRegs + 2 * kWsConsumerRegs) <= 65536,
                "ws registers");
  static_assert(T::BN % RSTEP == 0 && T::KC % 2 == 0, "ws tile");
  // The release after a stage's first k-block needs two wgmma groups in it (the first group's
  // wait leaves the previous stage's last group in flight, the second's retires it).
  static_assert(T::KG <= 2, "ws tile: at least two wgmma groups a k-block");
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[T::STAGES];
  __shared__ __align__(8) uint64_t empty_bar[T::STAGES];
  // The producer's: where each tile row's activations start (null past the tile's rows).
  __shared__ const __nv_bfloat16* s_src[T::BN];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_u32(smem_raw) & 1023)) & 1023);

  const int tid = threadIdx.x;
  if (tid == 0) {
#pragma unroll 1
    for (int s = 0; s < T::STAGES; ++s) {
      // full: the producer's arrive.expect_tx + one cp.async arrival per producer thread;
      // empty: one arrival per consumer warp.
      sm90::mbar_init(&full_bar[s], 1 + kWsProducerThreads);
      sm90::mbar_init(&empty_bar[s], T::THREADS / 32);
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

  if (tid >= T::THREADS) {
    // ---- producer warpgroup ----
    sm90::warpgroup_reg_dealloc<kWsProducerRegs>();
    // Thread p copies 16-byte chunk c = p % 8 of tile rows p / 8, p / 8 + RSTEP, ... (rows past
    // the tile's tokens are not loaded: an MMA column depends only on its own B column, and
    // those columns are never stored).
    const int p = tid - T::THREADS, c = p % 8, r0 = p / 8;
    uint32_t g = 0;  // stages filled so far (the consumers count the same sequence)
#pragma unroll 1
    for (int item = blockIdx.x; item < total; item += gridDim.x) {
      const int4 tile = a.tiles[item / row_blocks];
      const int rbc = item % row_blocks;
      const int first = tile.y, rows = tile.z;
      // Every producer thread has issued the previous item's copies (read their sources).
      sm90::named_barrier_sync(1, kWsProducerThreads);
      for (int r = p; r < T::BN; r += kWsProducerThreads)
        s_src[r] =
            r < rows ? a.act + size_t(a.act_row ? a.act_row[first + r] : first + r) * a.k : nullptr;
      sm90::named_barrier_sync(1, kWsProducerThreads);
      const uint8_t* wbase = a.w + size_t(tile.x) * a.w_stride + size_t(rbc) * MTILES * KB * TILE;
#pragma unroll 1
      for (int ch = 0; ch < nch; ++ch, ++g) {
        const int s = int(g % T::STAGES);
        sm90::mbar_wait(&empty_bar[s], ((g / T::STAGES) & 1u) ^ 1u);
        uint8_t* st = smem + s * STAGE;
        const uint32_t st32 = sm90::smem_u32(st);
        const int kb0 = ch * T::KC, nk = min(T::KC, KB - kb0);
        if (p == 0) {
          const uint32_t bytes = uint32_t(nk * TILE);
          sm90::mbar_arrive_expect_tx(&full_bar[s], bytes * MTILES);
#pragma unroll
          for (int gm = 0; gm < MTILES; ++gm)
            sm90::bulk_load(st + B_BYTES + gm * (T::KC * TILE),
                            wbase + (size_t(gm) * KB + kb0) * TILE, bytes, &full_bar[s],
                            sm90::kEvictNormal);
        }
#pragma unroll 1
        for (int r = r0; r < rows && r < T::BN; r += RSTEP) {
          const __nv_bfloat16* src = s_src[r] + size_t(kb0) * 64 + c * 8;
          const uint32_t dst = st32 + r * 128 + ((c ^ (r & 7)) << 4);
#pragma unroll
          for (int kbl = 0; kbl < T::KC; ++kbl)
            if (kbl < nk) sm90::cp_async_16(dst + kbl * B_KB, src + kbl * 64);
        }
        sm90::cp_async_mbar_arrive_noinc(&full_bar[s]);
      }
    }
    // Tail: the warpgroup leaves only once the consumers have released every stage, i.e. after
    // all of its copies have landed and been read (none still in flight at its exit).
#pragma unroll 1
    for (int i = 0; i < T::STAGES; ++i, ++g)
      sm90::mbar_wait(&empty_bar[g % T::STAGES], ((g / T::STAGES) & 1u) ^ 1u);
    return;
  }

  // ---- consumer warpgroups ----
  sm90::warpgroup_reg_alloc<kWsConsumerRegs>();
  // The warpgroup index through a broadcast, so the compiler keeps it (and the addresses built
  // from it) in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int t = tid % 128, warp = t / 32, lane = t % 32;
  const int rp = 8 * warp + lane / 4;  // this thread's row-pair scale record
  uint32_t afr[2][T::KG][T::MT][4];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int kq = 0; kq < T::KG; ++kq)
#pragma unroll
      for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) afr[b][kq][mt][i] = 0u;
  auto release = [&](int s) {
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(&empty_bar[s]);
  };

  uint32_t g = 0;
#pragma unroll 1
  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const int4 tile = a.tiles[item / row_blocks];
    const int rbc = item % row_blocks;
    const int e = tile.x, first = tile.y, rows = tile.z;
    const Fp4Epilogue ep = a.epi[e];

    float acc[T::MT][NACC];
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[mt][i] = 0.0f;

    // The item's stages at one MMA width N (a template argument, as in moe_gemm.cuh).
    auto mainloop = [&](auto width) {
      constexpr int N = decltype(width)::value;
      // k-blocks of a stage alternate A buffers when a k-block holds an odd number of groups.
      constexpr int P1 = (4 / T::KG) % 2;
      int pending = -1;  // the stage whose last wgmma group may still be in flight
#pragma unroll 1
      for (int ch = 0; ch < nch; ++ch, ++g) {
        const int s = int(g % T::STAGES);
        sm90::mbar_wait(&full_bar[s], (g / T::STAGES) & 1u);
        // The activations (cp.async: the generic proxy) are read next by the async proxy.
        sm90::fence_proxy_async_smem();
        uint8_t* st = smem + s * STAGE;
        const int nk = min(T::KC, KB - ch * T::KC);  // even: K % 128 == 0, KC even
        const uint8_t* w = st + B_BYTES + wg * T::MT * T::KC * TILE;
#pragma unroll 1
        for (int kbl = 0; kbl < nk; kbl += 2) {
          gemm_kblock<F, T, N, 0>(w + kbl * TILE,
                                  sm90::desc_k_sw128(sm90::smem_u32(st + kbl * B_KB)), ep, t, rp,
                                  afr, acc);
          if (pending >= 0) {  // its last group retired by this k-block's second group's wait
            release(pending);
            pending = -1;
          }
          gemm_kblock<F, T, N, P1>(w + (kbl + 1) * TILE,
                                   sm90::desc_k_sw128(sm90::smem_u32(st + (kbl + 1) * B_KB)), ep, t,
                                   rp, afr, acc);
        }
        pending = s;
      }
      sm90::warpgroup_wait<0>();
#pragma unroll
      for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int i = 0; i < NACC; ++i) sm90::warpgroup_fence_operand(acc[mt][i]);
      if (pending >= 0) release(pending);
    };
    for_mma_width<T::BN>(rows, mainloop);
    gemm_epilogue<T, GATE_UP>(a, ep, acc, rbc * MTILES + wg * T::MT, warp, lane, first, rows);
  }
}

template <ExpertFormat F, class T, bool GATE_UP>
void launch_moe_gemm_ws_instance(const GemmArgs& a, const LaunchCtx& c) {
  launch_persistent_gemm<moe_gemm_ws_kernel<F, T, GATE_UP>>(
      T::THREADS + kWsProducerThreads, gemm_smem_bytes<F, T>(), "moe warp-specialised expert GEMM",
      T::BN, a, c);
}

template <ExpertFormat F>
void launch_moe_gemm_ws_impl(int tile_n, bool gate_up, const GemmArgs& a, const LaunchCtx& c) {
  switch (tile_n) {
    case 128:
      return gate_up ? launch_moe_gemm_ws_instance<F, TileN128, true>(a, c)
                     : launch_moe_gemm_ws_instance<F, TileN128, false>(a, c);
    case 256:
      return gate_up ? launch_moe_gemm_ws_instance<F, TileN256, true>(a, c)
                     : launch_moe_gemm_ws_instance<F, TileN256, false>(a, c);
    default:
      throw Error(cat("moe warp-specialised expert GEMM: unsupported token tile ", tile_n));
  }
}

#endif  // __CUDACC__

// Host launchers (moe_gemm_ws_{mxfp4,nvfp4}.cu): tile_n 128 or 256; n_rows a multiple of the
// tile's weight rows, k % 128 == 0.
void launch_moe_gemm_ws_mxfp4(int tile_n, bool gate_up, const GemmArgs& a, const LaunchCtx& c);
void launch_moe_gemm_ws_nvfp4(int tile_n, bool gate_up, const GemmArgs& a, const LaunchCtx& c);

}  // namespace dsv4::cuda::moe
