// The weight-streaming ceiling of the MoE decode expert GEMM: what HBM delivers to persistent
// CTAs that stream contiguous 64-row items through a ring of bulk-copy stages, as
// moe_gemm_stream.cuh does, with the consumers only releasing the stages (no dequantisation,
// no MMA) -- and, beside it, a plain ld.global stream of the same bytes. The byte volumes are
// the routed experts' packed NVFP4 weights of one MoE stage at the real shapes (real_config.h):
// a single token's 6 experts (where launch and ramp-up are a large share) and a 128-token
// batch's ~243 distinct experts. The gap between this and moe_bench's moe_gemm_*_stream rows is
// the GEMM's own cost; the gap between this and the HBM figure is the copy pattern's.
//
// Lines (bench_util.h JSON): weight_stream_ring (stage bytes x stages, CTAs per SM) and
// weight_stream_ldg, TBps over the streamed bytes. Usage: weight_stream_bench.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/error.h"
#include "cuda/bench_util.h"
#include "cuda/real_config.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/common/sm90/mbarrier.cuh"
#include "ops/cuda/common/sm90/tma.cuh"

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

int sm_count() {
  int dev = 0, n = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&dev));
  DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

template <int STAGE, int STAGES, int CW>
void ring(const Case& c, const DeviceBuffer<uint8_t>& buf, int per_sm) {
  DSV4_CHECK(c.item_bytes % STAGE == 0, "weight_stream_bench: ", c.name, " item of ", c.item_bytes,
             " bytes is not a whole number of ", STAGE, "-byte stages");
  auto k = ring_kernel<STAGE, STAGES, CW>;
  const int smem = STAGE * STAGES;
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const size_t total = size_t(c.items) * c.item_bytes;
  const int regions = int(buf.size() / total), grid = sm_count() * per_sm;
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
  const int regions = int(buf.size() / total), grid = 2 * sm_count();
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

int main() {
  using namespace dsv4;
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
