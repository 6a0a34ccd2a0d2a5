// Instantiations and launch of the weight-streaming GEMM (stream_gemm.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/gemm/fp8_gemm_heuristic.h"
#include "ops/cuda/gemm/stream_gemm.cuh"
#include "ops/cuda/gemm/stream_gemm.h"
#include "ops/cuda/gemm/tensor_map.h"

namespace dsv4::cuda::detail {

namespace {

using stream_gemm::Args;
using stream_gemm::WeightMaps;

static_assert(sizeof(StreamGemmLaunch::more_w) / sizeof(StreamGemmWeight) ==
              gemm_cfg::kStreamMaxGroups - 1);

template <int kMT, bool kFp8>
auto kernel_of() {
  return stream_gemm::stream_gemm_kernel<kMT, kFp8, gemm_cfg::stream_stages(kMT, kFp8)>;
}

// Per device: the kernel's attributes set and its residency per cluster size measured.
template <int kMT, bool kFp8>
const StreamResidency& residency() {
  constexpr int kSmem = gemm_cfg::stream_smem_bytes(kMT, kFp8);
  static std::atomic<uint64_t> once{0};
  static StreamResidency per_device[kMaxDevices];
  const int dev = current_device();
  once_per_device(once, [&] {
    auto kernel = kernel_of<kMT, kFp8>();
    DSV4_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    // Clusters of up to 16 CTAs (beyond the portable 8) where the device places them.
    const bool non_portable =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
        cudaSuccess;
    if (!non_portable) (void)cudaGetLastError();  // not sticky: clear it
    StreamResidency r;
    r.max_splits = 0;
    int per_sm = 0;
    DSV4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                                  gemm_cfg::kStreamThreads, kSmem));
    r.resident[1] = per_sm * sm_count();
    if (r.resident[1] > 0) r.max_splits = 1;
    const int top = non_portable ? gemm_cfg::kStreamMaxSplits : gemm_cfg::kStreamPortableSplits;
    for (int s = 2; s <= top; ++s) {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(1, s, 1);
      cfg.blockDim = dim3(gemm_cfg::kStreamThreads, 1, 1);
      cfg.dynamicSmemBytes = kSmem;
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = 1;
      attr.val.clusterDim.y = s;
      attr.val.clusterDim.z = 1;
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        clusters = 0;
      }
      r.resident[s] = clusters * s;
      if (clusters == 0) break;  // every split up to max_splits is placeable
      r.max_splits = s;
    }
    DSV4_CHECK(r.max_splits >= 1, "stream GEMM: the device places no CTA of the kernel (", kSmem,
               " bytes of shared memory)");
    per_device[dev] = r;
  });
  return per_device[dev];
}

// The residency the plans use: the least over the four token widths, so that the K split (and
// with it the fp32 summation order) of a weight is the same at every m <= 64: a token's output
// does not depend on how many others share its step.
template <bool kFp8>
StreamResidency plan_residency() {
  const StreamResidency* v[4] = {&residency<8, kFp8>(), &residency<16, kFp8>(),
                                 &residency<32, kFp8>(), &residency<64, kFp8>()};
  StreamResidency r = *v[0];
  for (const StreamResidency* o : v) {
    r.max_splits = std::min(r.max_splits, o->max_splits);
    for (int s = 1; s <= gemm_cfg::kStreamMaxSplits; ++s)
      r.resident[s] = std::min(r.resident[s], o->resident[s]);
  }
  return r;
}

template <int kMT, bool kFp8>
void launch_tokens(const StreamGemmLaunch& p, cudaStream_t stream) {
  constexpr int kSmem = gemm_cfg::stream_smem_bytes(kMT, kFp8);
  auto kernel = kernel_of<kMT, kFp8>();
  const StreamResidency res = plan_residency<kFp8>();

  const int elem = kFp8 ? 1 : 2;
  const int step_elems = gemm_cfg::kStreamStepBytes / elem;
  const CUtensorMapDataType dt =
      kFp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  DSV4_CHECK(p.more >= 0 && p.more < gemm_cfg::kStreamMaxGroups, "stream GEMM: ", p.more + 1,
             " weights in one launch (at most ", gemm_cfg::kStreamMaxGroups, ")");
  const int groups = 1 + p.more;
  WeightMaps maps{};
  Args args;
  args.m = p.m;
  args.token_blocks = (p.m + kMT - 1) / kMT;
  args.groups = groups;
  int tiles = 0;
  for (int g = 0; g < groups; ++g) {
    const StreamGemmWeight w =
        g == 0 ? StreamGemmWeight{p.w, p.n, p.w_scales_t, p.out, p.ldo} : p.more_w[g - 1];
    DSV4_CHECK(w.w && w.out && w.n >= 1 && w.ldo >= w.n && (!kFp8 || w.w_scales_t),
               "stream GEMM: weight ", g, " of the launch: bad operand (n = ", w.n,
               ", ldo = ", w.ldo, ")");
    maps.m[g] = make_tma_2d(w.w, dt, elem, w.n, p.k, int64_t(p.k) * elem, gemm_cfg::kStreamRows,
                            step_elems, TmaSwizzle::k128B);
    stream_gemm::Group& a = args.g[g];
    a.n = w.n;
    a.tile0 = tiles;
    a.w_scales_t = w.w_scales_t;
    a.w_scale_ld = (w.n + 127) / 128;
    a.out = w.out;
    a.ldo = w.ldo;
    tiles += (w.n + gemm_cfg::kStreamRows - 1) / gemm_cfg::kStreamRows;
  }
  const CUtensorMap tm_a =
      make_tma_2d(p.a, dt, elem, p.m, p.k, p.lda * elem, kMT, step_elems, TmaSwizzle::k128B);
  CUtensorMap tm_sa{};
  if constexpr (kFp8)
    tm_sa = make_tma_2d(p.a_scales_t, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, p.k / 128, p.m,
                        int64_t(p.a_ld) * 4, 1, kMT, TmaSwizzle::kNone);

  const int k_steps = int(int64_t(p.k) * elem / gemm_cfg::kStreamStepBytes);
  StreamPlan plan = plan_stream_tiles(p.m, tiles, k_steps, res);
  if (p.splits > 0) plan.splits = p.splits;
  DSV4_CHECK(plan.splits >= 1 && plan.splits <= res.max_splits && plan.splits <= k_steps,
             "stream GEMM: ", plan.splits, " K splits for ", k_steps, " K steps (1..",
             res.max_splits, " on this device)");
  args.k_steps = k_steps;

  LaunchConfig cfg;
  cfg.grid = dim3(unsigned(plan.tiles * args.token_blocks), plan.splits, 1);
  cfg.block = dim3(gemm_cfg::kStreamThreads, 1, 1);
  cfg.smem = kSmem;
  cfg.stream = stream;
  cfg.pdl = p.pdl;
  cfg.cluster = dim3(1, plan.splits, 1);  // a cluster attribute only when splits > 1
  launch_kernel(cfg, kernel, maps, tm_a, tm_sa, args);
}

template <bool kFp8>
void launch(const StreamGemmLaunch& p, cudaStream_t stream) {
  DSV4_CHECK(p.m >= 1 && p.m <= gemm_cfg::kStreamMaxM, "stream GEMM: m = ", p.m, " outside 1..",
             gemm_cfg::kStreamMaxM);
  switch (gemm_cfg::stream_tokens(p.m)) {
    case 8:
      return launch_tokens<8, kFp8>(p, stream);
    case 16:
      return launch_tokens<16, kFp8>(p, stream);
    case 32:
      return launch_tokens<32, kFp8>(p, stream);
    default:
      return launch_tokens<64, kFp8>(p, stream);
  }
}

}  // namespace

void stream_gemm_fp8(const StreamGemmLaunch& p, cudaStream_t stream) {
  launch<true>(p, stream);
}
void stream_gemm_bf16(const StreamGemmLaunch& p, cudaStream_t stream) {
  launch<false>(p, stream);
}

StreamResidency stream_residency_fp8() {
  return plan_residency<true>();
}

int stream_max_splits_fp8(int m) {
  DSV4_CHECK(m >= 1 && m <= gemm_cfg::kStreamMaxM, "stream GEMM: m = ", m);
  return plan_residency<true>().max_splits;
}

}  // namespace dsv4::cuda::detail
