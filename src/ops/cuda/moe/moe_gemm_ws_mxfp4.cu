// MXFP4 instances of the warp-specialised grouped expert GEMM.
#include "ops/cuda/moe/moe_gemm_ws.cuh"

namespace dsv4::cuda::moe {

void launch_moe_gemm_ws_mxfp4(int tile_n, bool gate_up, const GemmArgs& a, const LaunchCtx& c) {
  launch_moe_gemm_ws_impl<ExpertFormat::kMxfp4>(tile_n, gate_up, a, c);
}

}  // namespace dsv4::cuda::moe
