// MXFP4 instances of the decode-path (streaming) expert GEMM.
#include "ops/cuda/moe/moe_gemm_stream.cuh"

namespace dsv4::cuda::moe {

void launch_moe_gemm_stream_mxfp4(int tile_n, bool gate_up, bool quant_b, const GemmArgs& a,
                                  const LaunchCtx& c) {
  launch_moe_gemm_stream_impl<ExpertFormat::kMxfp4>(tile_n, gate_up, quant_b, a, c);
}

}  // namespace dsv4::cuda::moe
