// The prefill FP8 GEMM: CUTLASS's sm90 warp-specialised FP8 GEMM with blockwise scaling
// (KernelTmaWarpSpecializedCooperativeFP8Blockwise). Activation scales have granularity 1x128
// (per row and K block), weight scales 128x128, both fp32 and MN-major; each 128-wide K block is
// a separate wgmma accumulation promoted into fp32 registers with sa * sw, exactly the per-block
// contract of cpu::linear(kFp8). BF16 output through the TMA epilogue.
#include "ops/cuda/gemm/fp8_gemm_prefill.h"

#include <type_traits>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/gemm/fp8_gemm_config.h"
#include "ops/cuda/gemm/fp8_gemm_heuristic.h"
#include "ops/cuda/gemm/stream_gemm.h"

#if defined(DSV4_HAVE_CUTLASS)
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#endif

namespace dsv4::cuda::detail {

#if defined(DSV4_HAVE_CUTLASS)
namespace {

using namespace cute;

struct PrefillTypes {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // activations [m, k]
  using LayoutB = cutlass::layout::ColumnMajor;  // weights [n, k] row-major = K x N col-major
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignA = 16, kAlignB = 16, kAlignD = 8;

  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;  // MN-major both
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using TileShape = Shape<Int<gemm_cfg::kPrefillTileM>, Int<gemm_cfg::kPrefillTileN>,
                          Int<gemm_cfg::kPrefillTileK>>;
  using ClusterShape = Shape<_1, _2, _1>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlignD,
      ElementD, LayoutD, kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA, LayoutSFA>, kAlignA, ElementB, cute::tuple<LayoutB, LayoutSFB>, kAlignB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
};

template <class Scheduler>
struct PrefillGemm : PrefillTypes {
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                      PrefillTypes::CollectiveMainloop,
                                                      PrefillTypes::CollectiveEpilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using PersistentGemm = PrefillGemm<cutlass::gemm::PersistentScheduler>;
using StreamKGemm = PrefillGemm<cutlass::gemm::StreamKScheduler>;

// Rows of the activation-scale tensor the kernel is told about: m rounded up to 4. The scales are
// loaded by TMA with M as the contiguous dimension, and CUTLASS's can_implement
// (sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp, check_alignment<4> on
// layout_SFA in cutlass/detail/layout.hpp) requires that extent, not only the strides, to be a
// multiple of 16 bytes: with extent m it rejects every m % 4 != 0. The pad rows [m, sfa_rows)
// exist in memory (a_ld >= sfa_rows) and quantize_act_fp8 writes them as 0; whatever they hold,
// they scale only accumulator rows >= m, which A's TMA zero-fills and the epilogue never stores
// (scales are applied per row), so the real rows are unchanged.
int sfa_rows(int m) {
  return (m + 3) / 4 * 4;
}

// Host only: builds CUTLASS's arguments without querying the device (hw_info is set by the
// callers that launch or size the workspace).
template <class G>
typename G::Gemm::Arguments make_args(const PrefillArgs& p) {
  using StrideA = typename G::Kernel::StrideA;
  using StrideB = typename G::Kernel::StrideB;
  using StrideD = typename G::Kernel::StrideD;
  const int m = p.m, n = p.n, k = p.k, kb = k / 128;
  // Row-major [rows, k] (A, and B as [n, k]) and [m, ldy] (D): unit stride along the last mode.
  const StrideA sa = make_stride(int64_t(k), Int<1>{}, int64_t(m) * k);
  const StrideB sb = make_stride(int64_t(k), Int<1>{}, int64_t(n) * k);
  const StrideD sd = make_stride(int64_t(p.ldy), Int<1>{}, int64_t(m) * p.ldy);
  // Activation scales: element (row r, K index kk) -> r + (kk/128) * ld (the transposed,
  // TMA-aligned layout quantize_act_fp8 writes).
  const typename G::LayoutSFA lsfa = make_layout(
      make_shape(make_shape(Int<1>{}, sfa_rows(m)), make_shape(Int<128>{}, kb), 1),
      make_stride(make_stride(Int<0>{}, Int<1>{}), make_stride(Int<0>{}, p.a_ld), p.a_ld * kb));
  const typename G::LayoutSFB lsfb = G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));

  typename G::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {reinterpret_cast<const typename G::ElementA*>(p.a), sa,
       reinterpret_cast<const typename G::ElementB*>(p.w), sb, p.a_scales_t, lsfa, p.w_scales_t,
       lsfb},
      {{}, nullptr, sd, reinterpret_cast<typename G::ElementD*>(p.y), sd}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  if constexpr (std::is_same_v<G, StreamKGemm>) {
    using Params = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamKParams;
    args.scheduler.decomposition_mode =
        p.splits > 1 ? Params::DecompositionMode::SplitK : Params::DecompositionMode::StreamK;
    if (p.splits > 1) args.scheduler.splits = p.splits;
    args.scheduler.reduction_mode = Params::ReductionMode::Deterministic;
  }
  return args;
}

// make_args plus the current device (the stream-K workspace and grid depend on its SM count).
template <class G>
typename G::Gemm::Arguments make_device_args(const PrefillArgs& p) {
  auto args = make_args<G>(p);
  int dev = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&dev));
  args.hw_info.device_id = dev;
  args.hw_info.sm_count = sm_count();
  return args;
}

// What CUTLASS's can_implement does not check: it tests the strides of A, B and D as
// default-constructed StrideX{} (only their static unit modes), never the dynamic ones, so a
// misaligned ldy would only fail in cuTensorMapEncodeTiled at initialize (a printout in Release).
void check_layout(const PrefillArgs& p) {
  DSV4_CHECK(p.m > 0 && p.n > 0 && p.k > 0 && p.k % 128 == 0, "fp8_gemm: tensor-core shape m=", p.m,
             " n=", p.n, " k=", p.k);
  DSV4_CHECK(p.ldy >= p.n && p.ldy % 8 == 0, "fp8_gemm: tensor-core output stride ", p.ldy,
             " must be >= n (", p.n, ") and a multiple of 8");
  DSV4_CHECK(p.a_ld >= sfa_rows(p.m) && p.a_ld % 4 == 0, "fp8_gemm: activation-scale stride ",
             p.a_ld, " must be a multiple of 4 and >= m rounded up to 4 (", sfa_rows(p.m), ")");
}

template <class G>
bool can_implement(const PrefillArgs& p) {
  return G::Gemm::can_implement(make_args<G>(p)) == cutlass::Status::kSuccess;
}

bool use_stream_k(const PrefillArgs& p) {
  if (p.scheduler == PrefillScheduler::kAuto)
    return prefill_use_stream_k(p.m, p.n, p.k, sm_count());
  return p.scheduler == PrefillScheduler::kStreamK;
}

// p with kAuto's K decomposition filled in (prefill_split_k), so that the workspace size and the
// launch see the same arguments.
PrefillArgs resolved(const PrefillArgs& p) {
  PrefillArgs q = p;
  if (q.scheduler == PrefillScheduler::kAuto && q.splits == 0)
    q.splits = prefill_split_k(q.m, q.n, q.k, sm_count());
  return q;
}

template <class G>
void run(const PrefillArgs& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  check_layout(p);
  const auto args = make_device_args<G>(p);
  typename G::Gemm gemm;
  const size_t need = G::Gemm::get_workspace_size(args);
  DSV4_CHECK(workspace_bytes >= need, "fp8_gemm: workspace of ", workspace_bytes,
             " bytes, the tensor-core GEMM needs ", need);
  cutlass::Status st = gemm.can_implement(args);
  DSV4_CHECK(st == cutlass::Status::kSuccess, "fp8_gemm: CUTLASS cannot implement m=", p.m,
             " n=", p.n, " k=", p.k, " ldy=", p.ldy, " a_ld=", p.a_ld, " (scale rows ",
             sfa_rows(p.m), "): ", cutlassGetStatusString(st));
  st = gemm.initialize(args, need ? workspace : nullptr, stream);
  DSV4_CHECK(st == cutlass::Status::kSuccess,
             "fp8_gemm: CUTLASS initialize failed: ", cutlassGetStatusString(st));
  st = gemm.run(stream, nullptr, p.pdl);
  DSV4_CHECK(st == cutlass::Status::kSuccess,
             "fp8_gemm: CUTLASS run failed: ", cutlassGetStatusString(st));
  DSV4_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

size_t prefill_workspace_bytes(const PrefillArgs& args) {
  const PrefillArgs p = resolved(args);
  return use_stream_k(p)
             ? StreamKGemm::Gemm::get_workspace_size(make_device_args<StreamKGemm>(p))
             : PersistentGemm::Gemm::get_workspace_size(make_device_args<PersistentGemm>(p));
}

bool prefill_can_implement(const PrefillArgs& p) {
  check_layout(p);
  switch (p.scheduler) {
    case PrefillScheduler::kPersistent:
      return can_implement<PersistentGemm>(p);
    case PrefillScheduler::kStreamK:
      return can_implement<StreamKGemm>(p);
    case PrefillScheduler::kAuto:
      break;
  }
  return can_implement<PersistentGemm>(p) && can_implement<StreamKGemm>(p);
}

void prefill_gemm(const PrefillArgs& args, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream) {
  const PrefillArgs p = resolved(args);
  if (use_stream_k(p))
    run<StreamKGemm>(p, workspace, workspace_bytes, stream);
  else
    run<PersistentGemm>(p, workspace, workspace_bytes, stream);
}

#else

size_t prefill_workspace_bytes(const PrefillArgs&) {
  return 0;
}
bool prefill_can_implement(const PrefillArgs&) {
  throw Error("fp8_gemm: the tensor-core path needs CUTLASS (scripts/fetch_cutlass.sh)");
}
void prefill_gemm(const PrefillArgs&, void*, size_t, cudaStream_t) {
  throw Error("fp8_gemm: the tensor-core path needs CUTLASS (scripts/fetch_cutlass.sh)");
}

#endif

}  // namespace dsv4::cuda::detail
