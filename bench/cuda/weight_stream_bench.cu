// The weight-streaming ceiling of the MoE decode expert GEMM: what HBM delivers to persistent
// CTAs that stream contiguous 64-row items through a ring of bulk-copy stages, as
// moe_gemm_stream.cuh does, with the consumers only releasing the stages (no dequantisation,
// no MMA) -- and, beside it, a plain ld.global stream of the same bytes. The byte volumes are
// the routed experts' packed NVFP4 weights of one MoE stage at the real shapes (real_config.h):
// a single token's 6 experts (where launch and ramp-up are a large share) and a 128-token
// batch's ~243 distinct experts. The gap between this and moe_bench's moe_gemm_*_stream rows is
// the GEMM's own cost; the gap between this and the HBM figure is the copy pattern's.
//
// The dense FP8 stream GEMM's pattern too (stream_gemm.cuh): one CTA per 128-row weight tile
// and K range, its producer loading 128 rows x 128 bytes a stage with a 2-D TMA box (swizzled)
// from the row-major [n, K] weight -- 128 segments of 128 bytes, K bytes apart -- beside the
// same boxes from a tiled copy where each box's 16 KB are contiguous: whether the row-major
// pattern is what holds the decode GEMMs near 2.5 TB/s.
//
// Lines (bench_util.h JSON): weight_stream_ring (stage bytes x stages, CTAs per SM),
// weight_stream_ldg, weight_stream_box (layout, weight shape, splits), TBps over the streamed
// bytes. Usage: weight_stream_bench [--box-only].
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/bench_util.h"
#include "cuda/real_config.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/common/sm90/mbarrier.cuh"
#include "ops/cuda/common/sm90/tma.cuh"
#include "ops/cuda/gemm/tensor_map.h"

namespace dsv4 {
namespace {

using cuda::DeviceBuffer;
namespace sm90 = cuda::sm90;

// One producer lane fills STAGE-byte stages of the CTA's items (item = blockIdx.x + j * grid);
// CW consumer warps wait for each stage and release it.
template <int STAGE, int STAGES, int CW>
__global__ void __launch_bounds__(CW * 32 + 32)
    ring_kernel(const uint8_t* base, long item_bytes, int n_items) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      sm90::mbar_init(&full[s], 1);
      sm90::mbar_init(&empty[s], CW);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  const int nch = int(item_bytes / STAGE);
  uint32_t g = 0;
  if (tid >= CW * 32) {
    if (tid % 32 != 0) return;
    for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
      const uint8_t* src = base + size_t(item) * item_bytes;
      for (int ch = 0; ch < nch; ++ch, ++g) {
        const int s = int(g % STAGES);
        sm90::mbar_wait(&empty[s], ((g / STAGES) & 1u) ^ 1u);
        sm90::mbar_arrive_expect_tx(&full[s], STAGE);
        sm90::bulk_load(smem + s * STAGE, src + size_t(ch) * STAGE, STAGE, &full[s],
                        sm90::kEvictFirst);
      }
    }
    // Leave only once every copy has landed and been released.
    for (int i = 0; i < STAGES; ++i, ++g)
      sm90::mbar_wait(&empty[g % STAGES], ((g / STAGES) & 1u) ^ 1u);
    return;
  }
  for (int item = blockIdx.x; item < n_items; item += gridDim.x)
    for (int ch = 0; ch < nch; ++ch, ++g) {
      const int s = int(g % STAGES);
      sm90::mbar_wait(&full[s], (g / STAGES) & 1u);
      __syncwarp();
      if (tid % 32 == 0) sm90::mbar_arrive(&empty[s]);
    }
}

// Every thread streams 16-byte words, UNROLL loads in flight; the XOR keeps them live.
template <int UNROLL>
__global__ void ldg_kernel(const uint4* p, long n16, uint32_t* sink) {
  uint32_t acc = 0;
  const long stride = long(gridDim.x) * blockDim.x;
  long i = long(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // never in practice; the loads cannot be dropped
}

// The stream GEMM's copy pattern alone: CTA (tile, split) streams K steps [split * k_steps /
// splits, ...) of its 128-row tile through STAGES 16 KB stages; box (row, col) = (tile * 128,
// step * 128) of the row-major weight, or (tile * k_steps + step) * 128 rows into the tiled copy
// viewed as [n * K / 128, 128] (`tiled`). Consumers (4 warps) only release the stages.
template <int STAGES>
__global__ void __launch_bounds__(160)
    box_kernel(const __grid_constant__ CUtensorMap tm, int k_steps, int tiled) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  constexpr int kStage = 128 * 128;
  const int tid = threadIdx.x, tile = blockIdx.x, splits = gridDim.y, split = blockIdx.y;
  const int s0 = int(long(split) * k_steps / splits), s1 = int(long(split + 1) * k_steps / splits);
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      sm90::mbar_init(&full[s], 1);
      sm90::mbar_init(&empty[s], 4);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if (tid >= 128) {
    if (tid != 128) return;
    for (int i = 0; i < s1 - s0; ++i) {
      const int s = i % STAGES, step = s0 + i;
      if (i >= STAGES) sm90::mbar_wait(&empty[s], ((i / STAGES) - 1) & 1);
      sm90::mbar_arrive_expect_tx(&full[s], kStage);
      if (tiled)
        sm90::tma_load_2d(&tm, &full[s], smem + s * kStage, 0, (tile * k_steps + step) * 128,
                          sm90::kEvictFirst);
      else
        sm90::tma_load_2d(&tm, &full[s], smem + s * kStage, step * 128, tile * 128,
                          sm90::kEvictFirst);
    }
    return;
  }
  for (int i = 0; i < s1 - s0; ++i) {
    const int s = i % STAGES;
    sm90::mbar_wait(&full[s], (i / STAGES) & 1);
    __syncwarp();
    if (tid % 32 == 0) sm90::mbar_arrive(&empty[s]);
  }
}

void box(const char* name, long n, long k, int splits, bool tiled,
         const DeviceBuffer<uint8_t>& buf) {
  constexpr int kStages = 6;
  auto kern = box_kernel<kStages>;
  const int smem = kStages * 128 * 128 + 1024;
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const size_t total = size_t(n) * size_t(k);
  const int regions = int(buf.size() / total);
  const int k_steps = int(k / 128);
  std::vector<CUtensorMap> maps;
  for (int i = 0; i < regions; ++i) {
    const uint8_t* base = buf.data() + size_t(i) * total;
    maps.push_back(tiled ? cuda::make_tma_2d(base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, n * k / 128,
                                             128, 128, 128, 128, cuda::TmaSwizzle::k128B)
                         : cuda::make_tma_2d(base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, n, k, k, 128,
                                             128, cuda::TmaSwizzle::k128B));
  }
  bench::Result r;
  r.kernel = "weight_stream_box";
  r.shape = std::string(name) + (tiled ? " tiled" : " row-major") + " n=" + std::to_string(n) +
            " k=" + std::to_string(k) + " splits=" + std::to_string(splits) +
            " stages=6x16KB ctas=" + std::to_string(n / 128 * splits);
  r.us = bench::median_us([&](int i) {
    kern<<<dim3(unsigned(n / 128), unsigned(splits)), 160, smem>>>(maps[size_t(i % regions)],
                                                                   k_steps, tiled ? 1 : 0);
  });
  r.bytes = double(total);
  r.peer = "hbm_ceiling";
  r.peer_us = total / (bench::kHbmTBps * 1e6);
  r.emit();
}

struct Case {
  const char* name;
  long item_bytes;  // one 64-row block of a projection: 64 x K NVFP4 (2304 B per 64 x 64 tile)
  long items;
};

constexpr long kTileBytes = 2304;  // a 64 x 64 NVFP4 tile: 2048 B of codes, 256 B of scales

// `experts` experts' gate/up projections of a real model (rows 2 x inter over K = dim) and their
// down projections (rows dim over K = inter), in 64-row items.
Case gateup_case(const char* name, const ModelConfig& c, long experts) {
  return {name, c.dim / 64 * kTileBytes, experts * (2 * c.moe_inter_dim / 64)};
}
Case down_case(const char* name, const ModelConfig& c, long experts) {
  return {name, c.moe_inter_dim / 64 * kTileBytes, experts * (c.dim / 64)};
}

template <int STAGE, int STAGES, int CW>
void ring(const Case& c, const DeviceBuffer<uint8_t>& buf, int per_sm) {
  DSV4_CHECK(c.item_bytes % STAGE == 0, "weight_stream_bench: ", c.name, " item of ", c.item_bytes,
             " bytes is not a whole number of ", STAGE, "-byte stages");
  auto k = ring_kernel<STAGE, STAGES, CW>;
  const int smem = STAGE * STAGES;
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const size_t total = size_t(c.items) * c.item_bytes;
  const int regions = int(buf.size() / total), grid = cuda::sm_count() * per_sm;
  bench::Result r;
  r.kernel = "weight_stream_ring";
  r.shape = std::string(c.name) + " bytes=" + std::to_string(total) +
            " stage=" + std::to_string(STAGE) + "x" + std::to_string(STAGES) +
            " consumer_warps=" + std::to_string(CW) + " ctas_per_sm=" + std::to_string(per_sm);
  r.us = bench::median_us([&](int i) {
    k<<<grid, CW * 32 + 32, smem>>>(buf.data() + size_t(i % regions) * total, c.item_bytes,
                                    int(c.items));
  });
  r.bytes = double(total);
  r.peer = "hbm_ceiling";
  r.peer_us = total / (bench::kHbmTBps * 1e6);
  r.emit();
}

template <int UNROLL>
void ldg(const Case& c, const DeviceBuffer<uint8_t>& buf, DeviceBuffer<uint32_t>& sink) {
  const size_t total = size_t(c.items) * c.item_bytes;
  const int regions = int(buf.size() / total), grid = 2 * cuda::sm_count();
  bench::Result r;
  r.kernel = "weight_stream_ldg";
  r.shape = std::string(c.name) + " bytes=" + std::to_string(total) + " threads=512" +
            " ctas_per_sm=2 unroll=" + std::to_string(UNROLL);
  r.us = bench::median_us([&](int i) {
    ldg_kernel<UNROLL>
        <<<grid, 512>>>(reinterpret_cast<const uint4*>(buf.data() + size_t(i % regions) * total),
                        long(total / 16), sink.data());
  });
  r.bytes = double(total);
  r.peer = "hbm_ceiling";
  r.peer_us = total / (bench::kHbmTBps * 1e6);
  r.emit();
}

}  // namespace
}  // namespace dsv4

int main(int argc, char** argv) {
  using namespace dsv4;
  const bool box_only = argc > 1 && std::string(argv[1]) == "--box-only";
  try {
    // Flash: gate/up rows 2 x 2048 over K 4096, down rows 4096 over K 2048 (64 items an
    // expert each); top-6 experts at one token, ~243 at 128 tokens (random routing:
    // E (1 - (1 - k/E)^128) = 243.7). Pro: dims 7168 / 3072.
    const ModelConfig f = bench::real_config("flash", true), p = bench::real_config("pro", true);
    const int fk = f.n_activated_experts, pk = p.n_activated_experts;
    const Case cases[] = {
        gateup_case("flash_gateup_m1", f, fk),    down_case("flash_down_m1", f, fk),
        gateup_case("flash_gateup_m128", f, 243), down_case("flash_down_m128", f, 243),
        gateup_case("pro_gateup_m1", p, pk),      down_case("pro_down_m1", p, pk),
    };
    // Rotation: several copies of the largest volume (~2.3 GB) so no run starts from L2.
    DeviceBuffer<uint8_t> buf(size_t(6) << 30);
    DSV4_CUDA_CHECK(cudaMemset(buf.data(), 0x5a, buf.size()));
    DeviceBuffer<uint32_t> sink(4);
    // The dense FP8 weights of V4-Flash at decode (the engine's K splits: 1 at K 1024, 8 at
    // 8192 and 4096), and one large volume for the steady state.
    for (bool tiled : {false, true}) {
      box("flash wq_b", 32768, 1024, 1, tiled, buf);
      box("flash wq_b", 32768, 1024, 2, tiled, buf);
      box("flash wo_b", 4096, 8192, 8, tiled, buf);
      box("flash shared w1|w3", 4096, 4096, 8, tiled, buf);
      box("large", 32768, 8192, 2, tiled, buf);
    }
    if (box_only) return 0;
    for (const Case& c : cases) {
      ring<18432, 6, 16>(c, buf, 1);   // the stream GEMM's N8 geometry (8 tiles a stage)
      ring<18432, 10, 16>(c, buf, 1);  // deeper ring
      ring<36864, 5, 16>(c, buf, 1);   // larger stages
      ring<9216, 10, 8>(c, buf, 2);    // two CTAs an SM
      ldg<4>(c, buf, sink);
      ldg<8>(c, buf, sink);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weight_stream_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
