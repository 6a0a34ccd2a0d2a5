// MXFP4 instances of the grouped expert GEMM (one translation unit per format keeps the
// builds of the wgmma kernels parallel).
#include "ops/cuda/moe/moe_gemm.cuh"

namespace dsv4::cuda::moe {

void launch_moe_gemm_mxfp4(int tile_n, bool gate_up, const GemmArgs& a, const LaunchCtx& c) {
  launch_moe_gemm_impl<ExpertFormat::kMxfp4>(tile_n, gate_up, a, c);
}

}  // namespace dsv4::cuda::moe
