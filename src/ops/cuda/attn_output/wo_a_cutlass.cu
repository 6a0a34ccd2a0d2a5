// Prefill wo_a: CUTLASS sm90 mixed-input GEMM (TMA + warp-specialised cooperative wgmma). The
// FP8 weight is the register-sourced A operand (converted to BF16 and multiplied by its BF16
// per-row, per-128-K scale — both exact), the activations the BF16 B operand, fp32
// accumulation, BF16 out. Computed as z_g^T = W_g . o_g^T per group g (batch mode L = G):
//   A = W_g  [o_lora, in_g]  K-major, batch stride o_lora * in_g
//   B = o_g  [T, in_g]       K-major (row stride num_heads*512), batch stride in_g
//   D = z_g^T [o_lora, T]    column-major = z row-major [T, G*o_lora], batch stride o_lora
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "core/error.h"
#include "ops/cuda/attn_output/attn_output_config.h"
#include "ops/cuda/attn_output/wo_a_kernels.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/per_device.h"

#if defined(DSV4_HAVE_CUTLASS)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#endif

namespace dsv4::cuda {

#if defined(DSV4_HAVE_CUTLASS)
namespace {

using namespace cute;

using ElementW = cutlass::float_e4m3_t;
using ElementScale = cutlass::bfloat16_t;
using ElementAct = cutlass::bfloat16_t;
using ElementD = cutlass::bfloat16_t;
using LayoutW = cutlass::layout::RowMajor;       // [rows, K]: K-major A
using LayoutAct = cutlass::layout::ColumnMajor;  // K x T with K contiguous: K-major B
using LayoutD = cutlass::layout::ColumnMajor;    // rows contiguous
constexpr int kAlignW = 16, kAlignAct = 8, kAlignD = 8;

using ClusterShape = Shape<_1, _1, _1>;

// One CUTLASS kernel per CTA tile (weight rows, tokens, K).
template <class TileShape>
struct WoAGemm {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlignD,
      ElementD, LayoutD, kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cute::tuple<ElementW, ElementScale>,
      LayoutW, kAlignW, ElementAct, LayoutAct, kAlignAct, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                          CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// CUTLASS's persistent scheduler may want a small workspace. One per (device, stream): ranks run
// as threads on one or several GPUs, each on its own stream, concurrently; grown under a lock and
// never freed while the process runs: a CUDA graph captured with a smaller buffer keeps pointing at
// it, so a grown buffer is retired, not freed. Growing during a capture is refused (cudaMalloc
// there would break the capture).
void* workspace(size_t bytes, cudaStream_t stream) {
  struct Buffer {
    void* ptr = nullptr;
    size_t size = 0;
  };
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Buffer> buffers;
  static std::vector<void*> retired;  // still referenced by captured graphs; kept alive
  int dev = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  Buffer& b = buffers[{dev, stream}];
  if (bytes > b.size) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    DSV4_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    DSV4_CHECK(capture == cudaStreamCaptureStatusNone, "wo_a: the CUTLASS workspace must grow to ",
               bytes, " bytes (from ", b.size,
               ") inside a CUDA graph capture; run this shape eagerly first");
    if (b.ptr) retired.push_back(b.ptr);
    DSV4_CUDA_CHECK(cudaMalloc(&b.ptr, bytes));
    b.size = bytes;
  }
  return b.ptr;
}

template <class TileShape>
void run_wo_a(const WoAArgs& a, cudaStream_t stream) {
  using Gemm = typename WoAGemm<TileShape>::Gemm;
  using GemmKernel = typename WoAGemm<TileShape>::GemmKernel;
  using StrideW = typename GemmKernel::StrideA;
  using StrideAct = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;
  using StrideS = typename WoAGemm<TileShape>::CollectiveMainloop::StrideScale;
  const int M = a.o_lora, N = a.num_tokens, K = a.in_g, L = a.o_groups;
  const StrideW sw = make_stride(int64_t(K), Int<1>{}, int64_t(M) * K);
  const StrideAct sa = make_stride(a.ldo, Int<1>{}, int64_t(K));
  const StrideD sd = make_stride(Int<1>{}, a.ldz, int64_t(M));
  const StrideS ss = make_stride(Int<1>{}, int64_t(M), int64_t(M) * (K / 128));

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {M, N, K, L},
      {reinterpret_cast<const ElementW*>(a.w), sw, reinterpret_cast<const ElementAct*>(a.o), sa,
       reinterpret_cast<const ElementScale*>(a.w_scale_rows), ss, 128},
      {{1.0f, 0.0f}, nullptr, sd, reinterpret_cast<ElementD*>(a.z), sd}};
  args.hw_info.sm_count = sm_count();

  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  DSV4_CHECK(st == cutlass::Status::kSuccess, "wo_a (CUTLASS mixed-input GEMM) cannot run M=", M,
             " N=", N, " K=", K, " L=", L, ": ", cutlassGetStatusString(st));
  const size_t ws = Gemm::get_workspace_size(args);
  st = gemm.initialize(args, ws ? workspace(ws, stream) : nullptr, stream);
  DSV4_CHECK(st == cutlass::Status::kSuccess,
             "wo_a: CUTLASS initialize failed: ", cutlassGetStatusString(st));
  st = gemm.run(stream);
  DSV4_CHECK(st == cutlass::Status::kSuccess,
             "wo_a: CUTLASS run failed: ", cutlassGetStatusString(st));
  DSV4_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

// The CTA tile's tokens by attn_output_cfg::wo_a_tile_tokens.
void wo_a_tensor_core(const WoAArgs& a, cudaStream_t stream) {
  if (attn_output_cfg::wo_a_tile_tokens(a.num_tokens, a.o_lora, a.o_groups, sm_count()) == 256)
    run_wo_a<Shape<_128, _256, _64>>(a, stream);
  else
    run_wo_a<Shape<_128, _128, _64>>(a, stream);
}

#else

void wo_a_tensor_core(const WoAArgs&, cudaStream_t) {
  throw Error(
      "wo_a: the tensor-core (prefill) path needs CUTLASS; this build has none "
      "(scripts/fetch_cutlass.sh, then reconfigure)");
}

#endif

}  // namespace dsv4::cuda
