// Instantiations and launch of the weight-streaming GEMM (stream_gemm.cuh).
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/gemm/fp8_gemm_heuristic.h"
#include "ops/cuda/gemm/stream_gemm.cuh"
#include "ops/cuda/gemm/stream_gemm.h"
#include "ops/cuda/gemm/tensor_map.h"

namespace dsv4::cuda::detail {

int sm_count() {
  static std::mutex mu;
  static std::vector<int> cache;
  int dev = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (int(cache.size()) <= dev) cache.resize(dev + 1, 0);
  if (cache[dev] == 0)
    DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&cache[dev], cudaDevAttrMultiProcessorCount, dev));
  return cache[dev];
}

namespace {

using stream_gemm::Args;

template <int kMT, bool kFp8>
void launch_tokens(const StreamGemmLaunch& p, cudaStream_t stream) {
  constexpr int kStages = gemm_cfg::stream_stages(kMT, kFp8);
  constexpr int kSmem = gemm_cfg::stream_smem_bytes(kMT, kFp8);
  auto kernel = stream_gemm::stream_gemm_kernel<kMT, kFp8, kStages>;
  static std::atomic<uint64_t> once{0};
  once_per_device(once, [&] {
    DSV4_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  });

  const int elem = kFp8 ? 1 : 2;
  const int step_elems = gemm_cfg::kStreamStepBytes / elem;
  const CUtensorMapDataType dt =
      kFp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUtensorMap tm_w = make_tma_2d(p.w, dt, elem, p.n, p.k, int64_t(p.k) * elem,
                                       gemm_cfg::kStreamRows, step_elems, TmaSwizzle::k128B);
  const CUtensorMap tm_a =
      make_tma_2d(p.a, dt, elem, p.m, p.k, p.lda * elem, kMT, step_elems, TmaSwizzle::k128B);
  CUtensorMap tm_sa{};
  if constexpr (kFp8)
    tm_sa = make_tma_2d(p.a_scales_t, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, p.k / 128, p.m,
                        int64_t(p.a_ld) * 4, 1, kMT, TmaSwizzle::kNone);

  const int k_steps = int(int64_t(p.k) * elem / gemm_cfg::kStreamStepBytes);
  StreamPlan plan = plan_stream(p.m, p.n, k_steps, sm_count());
  if (p.splits > 0) plan.splits = p.splits;
  DSV4_CHECK(
      plan.splits >= 1 && plan.splits <= gemm_cfg::kStreamMaxSplits && plan.splits <= k_steps,
      "stream GEMM: ", plan.splits, " K splits for ", k_steps, " K steps (1..",
      gemm_cfg::kStreamMaxSplits, ")");

  Args args;
  args.m = p.m;
  args.n = p.n;
  args.k_steps = k_steps;
  args.w_scales_t = p.w_scales_t;
  args.w_scale_ld = (p.n + 127) / 128;
  args.out = p.out;
  args.ldo = p.ldo;

  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(plan.tiles, plan.splits, 1);
  cfg.blockDim = dim3(gemm_cfg::kStreamThreads, 1, 1);
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  int na = 0;
  if (plan.splits > 1) {
    attrs[na].id = cudaLaunchAttributeClusterDimension;
    attrs[na].val.clusterDim.x = 1;
    attrs[na].val.clusterDim.y = plan.splits;
    attrs[na].val.clusterDim.z = 1;
    ++na;
  }
  if (p.pdl) {
    attrs[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = na;
  DSV4_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, tm_w, tm_a, tm_sa, args));
}

template <bool kFp8>
void launch(const StreamGemmLaunch& p, cudaStream_t stream) {
  DSV4_CHECK(p.m >= 1 && p.m <= gemm_cfg::kStreamMaxTokens, "stream GEMM: m = ", p.m,
             " outside 1..", gemm_cfg::kStreamMaxTokens);
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

}  // namespace dsv4::cuda::detail
