// MoE host side: weight upload (repack), workspace, the stage sequence, heuristics.
#include "ops/cuda/moe/moe.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "core/error.h"
#include "ops/cuda/moe/moe_gemm.cuh"
#include "ops/cuda/moe/moe_gemm_stream.cuh"
#include "ops/cuda/moe/moe_gemm_ws.cuh"
#include "ops/cuda/moe/moe_kernels.h"

namespace dsv4::cuda::moe {
namespace {

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

template <typename T>
T* take(uint8_t*& p, size_t count) {
  T* r = reinterpret_cast<T*>(p);
  p += align256(count * sizeof(T));
  return r;
}

// Sizes in one place: carve_moe_workspace walks the same list.
MoeWorkspace carve(const MoeDeviceWeights& w, int m, int top_k, uint8_t* base, size_t* bytes) {
  uint8_t* p = base;
  const size_t pairs = size_t(m) * top_k, E = size_t(w.n_experts);
  MoeWorkspace ws;
  ws.logits = take<float>(p, size_t(m) * E);
  ws.scores = take<float>(p, size_t(m) * E);
  ws.sel = take<int32_t>(p, pairs);
  ws.wt = take<float>(p, pairs);
  ws.xq = take<__nv_bfloat16>(p, size_t(m) * w.dim);
  ws.counters = take<int32_t>(p, 4);
  ws.pair_pos = take<int32_t>(p, pairs);
  ws.sorted_row = take<int32_t>(p, pairs);
  ws.sorted_wt = take<float>(p, pairs);
  ws.expert_first = take<int32_t>(p, E + 1);
  ws.tiles = take<int4>(p, pairs);
  ws.plan_counts = take<int32_t>(p, plan_chunks(long(pairs)) * E);
  ws.act = take<__nv_bfloat16>(p, pairs * w.inter);
  ws.actq = take<__nv_bfloat16>(p, pairs * w.inter);
  ws.ye = take<__nv_bfloat16>(p, pairs * w.dim);
  if (bytes) *bytes = size_t(p - base);
  return ws;
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

}  // namespace

int gemm_tile_rows(int tile_n) {
  switch (tile_n) {
    case 8:
      return TileN8::BM;
    case 32:
      return TileN32::BM;
    case 64:
      return TileN64::BM;
    case 128:
      return TileN128::BM;
    case 256:
      return TileN256::BM;
    default:
      return 0;
  }
}

bool moe_fuses_act_quant(int tile_n) {
  switch (tile_n) {
    case 8:
      return gemm_quantises_b<TileN8>();
    case 32:
      return gemm_quantises_b<TileN32>();
    case 64:
      return gemm_quantises_b<TileN64>();
    case 128:
      return gemm_quantises_b<TileN128>();
    case 256:
      return gemm_quantises_b<TileN256>();
    default:
      return false;
  }
}

bool moe_fuses_act_quant(const MoeGemmChoice& c) {
  return c.quant_in_down;
}

int moe_launch_count(const MoeDeviceWeights& w, int m, int top_k, MoeGemmPath path) {
  const MoeGemmChoice gc = moe_gemm_choice(w, m, top_k, path);
  return 1 + (route_plan_fused(m, w.n_experts) ? 1 : 2) + 1 + (moe_fuses_act_quant(gc) ? 0 : 1) +
         1 + 1;
}

double MoeDeviceWeights::expert_checkpoint_bytes() const {
  const double bits = format == ExpertFormat::kMxfp4 ? 4.25 : 4.5;
  return 3.0 * double(inter) * dim * bits / 8.0;
}

MoeDeviceWeights upload_moe_weights(const MoeRef& ref) {
  MoeDeviceWeights w;
  const int E = static_cast<int>(ref.experts.size());
  DSV4_CHECK(E > 0 && E <= kMaxExperts, "moe: ", E, " routed experts (1..", kMaxExperts,
             " supported)");
  DSV4_CHECK(ref.gate && ref.gate->dtype == DType::kBF16 && ref.gate->shape.size() == 2 &&
                 ref.gate->shape[0] == E,
             "moe: gate must be BF16 [", E, ", dim]");
  const TensorView& g = *ref.gate;
  w.n_experts = E;
  w.dim = static_cast<int>(g.shape[1]);
  DSV4_CHECK(w.dim % 128 == 0, "tensor '", g.name, "': dim ", w.dim, " is not a multiple of 128");
  std::vector<uint16_t> gate(size_t(E) * w.dim);
  std::memcpy(gate.data(), g.data, gate.size() * 2);
  w.gate = DeviceBuffer<uint16_t>(gate);
  if (ref.bias) {
    DSV4_CHECK(ref.bias->dtype == DType::kF32 && ref.bias->numel() == E, "tensor '", ref.bias->name,
               "': expected F32 [", E, "]");
    std::vector<float> b(E);
    std::memcpy(b.data(), ref.bias->data, size_t(E) * 4);
    w.bias = DeviceBuffer<float>(b);
  }
  if (ref.tid2eid) {
    const TensorView& t = *ref.tid2eid;
    DSV4_CHECK((t.dtype == DType::kI64 || t.dtype == DType::kI32) && t.shape.size() == 2,
               "tensor '", t.name, "': expected I64/I32 [vocab, top_k]");
    w.vocab = static_cast<int>(t.shape[0]);
    w.hash_top_k = static_cast<int>(t.shape[1]);
    std::vector<int32_t> ids(size_t(t.numel()));
    for (size_t i = 0; i < ids.size(); ++i) {
      int64_t v;
      if (t.dtype == DType::kI64)
        std::memcpy(&v, t.data + 8 * i, 8);
      else {
        int32_t v32;
        std::memcpy(&v32, t.data + 4 * i, 4);
        v = v32;
      }
      DSV4_CHECK(v >= 0 && v < E, "tensor '", t.name, "': expert id ", v, " out of range [0, ", E,
                 ")");
      ids[i] = static_cast<int32_t>(v);
    }
    w.tid2eid = DeviceBuffer<int32_t>(ids);
  }

  const ExpertRef& e0 = ref.experts[0];
  DSV4_CHECK(e0.w1.weight && e0.w2.weight && e0.w3.weight, "moe: expert 0 lacks a projection");
  w.format = e0.w1.format;
  w.inter = static_cast<int>(e0.w1.weight->shape[0]);
  DSV4_CHECK(w.inter % 128 == 0, "tensor '", e0.w1.weight->name, "': inter ", w.inter,
             " is not a multiple of 128");
  for (const ExpertRef& e : ref.experts)
    for (const Fp4Ref* r : {&e.w1, &e.w2, &e.w3}) {
      DSV4_CHECK(r->weight && r->format == w.format, "tensor '", r->weight ? r->weight->name : "?",
                 "': every routed expert of a layer must use one FP4 format (",
                 expert_format_name(w.format), ")");
      const bool down = r == &e.w2;
      const std::vector<int64_t> want = down ? std::vector<int64_t>{w.dim, w.inter / 2}
                                             : std::vector<int64_t>{w.inter, w.dim / 2};
      DSV4_CHECK(r->weight->shape == want, "tensor '", r->weight->name, "': expected ",
                 shape_str(want), ", got ", shape_str(r->weight->shape));
    }

  // Repack on all cores; each worker uploads its experts into place.
  const PackedFp4 p13 = pack_fp4_gate_up(e0.w1, e0.w3);
  const PackedFp4 p2 = pack_fp4(e0.w2);
  w.w13_stride = p13.bytes.size();
  w.w2_stride = p2.bytes.size();
  w.w13 = DeviceBuffer<uint8_t>(w.w13_stride * E);
  w.w2 = DeviceBuffer<uint8_t>(w.w2_stride * E);
  std::vector<Fp4Epilogue> epi13(E), epi2(E);
  int dev = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&dev));
  const int workers = std::max(1, std::min<int>(E, int(std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  std::vector<std::string> errors(workers);
  for (int t = 0; t < workers; ++t)
    pool.emplace_back([&, t] {
      try {
        DSV4_CUDA_CHECK(cudaSetDevice(dev));
        for (int e = t; e < E; e += workers) {
          const ExpertRef& x = ref.experts[e];
          const PackedFp4 a = pack_fp4_gate_up(x.w1, x.w3);
          const PackedFp4 b = pack_fp4(x.w2);
          DSV4_CHECK(a.bytes.size() == w.w13_stride && b.bytes.size() == w.w2_stride,
                     "moe: expert ", e, " packs to a different size than expert 0");
          epi13[e] = a.epi;
          epi2[e] = b.epi;
          DSV4_CUDA_CHECK(cudaMemcpy(w.w13.data() + e * w.w13_stride, a.bytes.data(),
                                     a.bytes.size(), cudaMemcpyHostToDevice));
          DSV4_CUDA_CHECK(cudaMemcpy(w.w2.data() + e * w.w2_stride, b.bytes.data(), b.bytes.size(),
                                     cudaMemcpyHostToDevice));
        }
      } catch (const std::exception& ex) {
        errors[t] = ex.what();
      }
    });
  for (std::thread& th : pool) th.join();
  for (const std::string& s : errors)
    if (!s.empty()) throw Error(s);
  w.epi13 = DeviceBuffer<Fp4Epilogue>(epi13);
  w.epi2 = DeviceBuffer<Fp4Epilogue>(epi2);
  return w;
}

size_t moe_workspace_bytes(const MoeDeviceWeights& w, int m, int top_k) {
  size_t bytes = 0;
  carve(w, m, top_k, nullptr, &bytes);
  return bytes;
}

MoeWorkspace carve_moe_workspace(const MoeDeviceWeights& w, int m, int top_k, void* base) {
  return carve(w, m, top_k, static_cast<uint8_t*>(base), nullptr);
}

void moe_forward(const MoeDeviceWeights& w, const MoeArgs& a) {
  const MoeParams& p = a.p;
  DSV4_CHECK(a.m >= 0, "moe_forward: m = ", a.m);
  DSV4_CHECK(a.gemm_ctas >= 0, "moe_forward: gemm_ctas = ", a.gemm_ctas, " (0: no cap)");
  DSV4_CHECK(p.score_func == ScoreFunc::kSqrtSoftplus || p.score_func == ScoreFunc::kSigmoid,
             "moe_forward: only the sqrt-softplus and sigmoid routers are implemented on CUDA");
  DSV4_CHECK(p.top_k >= 1 && p.top_k <= std::min(kMaxTopK, w.n_experts), "moe_forward: top_k ",
             p.top_k, " (1..", std::min(kMaxTopK, w.n_experts), " supported)");
  DSV4_CHECK(!w.hash() || (a.tokens && w.hash_top_k == p.top_k),
             "moe_forward: a hash layer needs token ids and tid2eid with top_k = ", p.top_k);
  if (a.m == 0) return;
  DSV4_CHECK(a.x && a.y && aligned16(a.x) && aligned16(a.y) && aligned16(a.shared),
             "moe_forward: x, y (and shared) must be 16-byte aligned device pointers");
  DSV4_CHECK(a.workspace && (reinterpret_cast<uintptr_t>(a.workspace) & 255) == 0 &&
                 a.workspace_bytes >= moe_workspace_bytes(w, a.m, p.top_k),
             "moe_forward: workspace must be 256-byte aligned and hold moe_workspace_bytes() = ",
             moe_workspace_bytes(w, a.m, p.top_k), " bytes");
  const MoeGemmChoice gc = moe_gemm_choice(w, a.m, p.top_k, a.gemm_path, a.tile_n, a.down_quant);
  router_path_choice(a.m, a.router_path);  // a forced router kernel that does not fit throws
  const int tile_n = gc.tile_n;

  const MoeWorkspace ws = carve_moe_workspace(w, a.m, p.top_k, a.workspace);
  const LaunchCtx c{a.stream, a.pdl};
  const int pairs = a.m * p.top_k;
  if (a.stages & kStageRoute) launch_router(c, w, a, ws);
  const bool both = (a.stages & kStageRoute) && (a.stages & kStagePlan);
  if (both && route_plan_fused(a.m, w.n_experts)) {
    launch_route_plan_small(c, w, a, ws, tile_n);
  } else {
    if (a.stages & kStageRoute) launch_route_select(c, w, a, ws);
    if (a.stages & kStagePlan) launch_plan(c, w, a, ws, tile_n);
  }
  auto gemm = [&](GemmArgs g, bool gate_up) {
    g.max_ctas = a.gemm_ctas;
    const bool mx = w.format == ExpertFormat::kMxfp4;
    if (gc.path == MoeGemmPath::kStream)
      (mx ? launch_moe_gemm_stream_mxfp4 : launch_moe_gemm_stream_nvfp4)(
          tile_n, gate_up, !gate_up && gc.quant_in_down, g, c);
    else if (gc.path == MoeGemmPath::kTiledWs)
      (mx ? launch_moe_gemm_ws_mxfp4 : launch_moe_gemm_ws_nvfp4)(tile_n, gate_up, g, c);
    else
      (mx ? launch_moe_gemm_mxfp4 : launch_moe_gemm_nvfp4)(tile_n, gate_up, g, c);
  };
  if (a.stages & kStageGateUp) {
    GemmArgs g;
    g.w = w.w13.data();
    g.w_stride = w.w13_stride;
    g.epi = w.epi13.data();
    g.n_rows = 2 * w.inter;
    g.k = w.dim;
    g.act = ws.xq;
    g.act_row = ws.sorted_row;
    g.tiles = ws.tiles;
    g.counters = ws.counters;
    g.pos_weight = ws.sorted_wt;
    g.swiglu_limit = p.swiglu_limit;
    g.out = ws.act;
    g.ldo = w.inter;
    gemm(g, true);
  }
  // Where the choice puts it, the down GEMM quantises its activations (kStageDown does both).
  const bool fused_quant = moe_fuses_act_quant(gc);
  if ((a.stages & kStageQuantAct) && !fused_quant)
    launch_quant_rows(c, ws.act, ws.actq, pairs, w.inter, ws.counters);
  if (a.stages & kStageDown) {
    GemmArgs g;
    g.w = w.w2.data();
    g.w_stride = w.w2_stride;
    g.epi = w.epi2.data();
    g.n_rows = w.dim;
    g.k = w.inter;
    g.act = fused_quant ? ws.act : ws.actq;
    g.act_q_out = fused_quant ? ws.actq : nullptr;
    g.tiles = ws.tiles;
    g.counters = ws.counters;
    g.out = ws.ye;
    g.ldo = w.dim;
    gemm(g, false);
  }
  if (a.stages & kStageCombine) {
    if (a.shared_ready) DSV4_CUDA_CHECK(cudaStreamWaitEvent(a.stream, a.shared_ready, 0));
    launch_combine(c, ws, a.m, p.top_k, a.shared, a.y, w.dim);
  }
}

}  // namespace dsv4::cuda::moe
