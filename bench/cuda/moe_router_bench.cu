// MoE router benchmark: the route stage (logits, scores, x quantisation, top-k / hash
// selection, weights) and the grouping, as moe_forward runs them, at the real shapes
// (real_config.h): V4-Flash (256 experts, dim 4096) and V4-Pro (384, 7168), top-6, score-routed
// and hash-routed layers, tokens M = 1, 8, 32, 128 (decode batches), 512 and 4096 (prefill).
//
// Lines (bench_util.h JSON): moe_router_<config>_<score|hash> = route + plan as moe_forward runs
// them (the launches a layer runs before its expert GEMMs), moe_router_only_<path>_<...> = the
// route stage alone (logits kernel + selection) with each logits kernel forced (gemv, mma,
// tiled; moe_router_only_mma8_/mma16_ = the fp64 MMA kernel at 8 / 16 rows a CTA, 33 <= M <= 512);
// the shape names the logits kernel. Each case is one CUDA graph per copy of the gate
// (rotated through more memory than the L2 holds, as the layers of a decode step are); bytes = the
// gate weight (BF16), FLOPs = 2 M E dim (fp64 FMAs: the ceiling is the HBM time of the gate at
// decode, the fp64 rate at prefill, not the BF16 tensor rate the roofline column assumes).
//
// Usage: moe_router_bench [filter ...]; a case runs when every filter names its config (flash,
// pro), its routing (score, hash) or its token count (m1 ... m4096), or is "decode" (M <= 128).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "cuda/bench_util.h"
#include "cuda/real_config.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/moe/moe.h"
#include "ops/cuda/moe/moe_kernels.h"

namespace dsv4 {
namespace {

namespace cm = cuda::moe;
using cuda::DeviceBuffer;

struct Config {
  const char* name;
  int E, K, dim;
  float route_scale;
};

// A real model's router (real_config.h); the expert format does not enter the route stage.
Config real_router(const char* name) {
  const ModelConfig c = bench::real_config(name, false);
  return {name, c.n_routed_experts, c.n_activated_experts, c.dim, c.route_scale};
}

// A case: the inputs and the workspace (shared: replays run one after another) and `copies`
// copies of the layer's router weights (gate, bias or tid2eid), rotated through.
struct Case {
  std::vector<cm::MoeDeviceWeights> w;
  DeviceBuffer<uint16_t> x, y;
  DeviceBuffer<int32_t> tokens;
  DeviceBuffer<uint8_t> ws;
  cm::MoeArgs args;
};

constexpr int kVocab = 4096;

cm::MoeDeviceWeights make_weights(const Config& c, bool hash, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const float gs = 1.0f / std::sqrt(float(c.dim));
  std::vector<uint16_t> gate(size_t(c.E) * c.dim);
  for (uint16_t& g : gate) g = float_to_bf16(gs * nd(rng));
  cm::MoeDeviceWeights w;
  w.n_experts = c.E;
  w.dim = c.dim;
  w.inter = 128;  // sizes only the (unused) GEMM regions of the workspace
  w.gate = DeviceBuffer<uint16_t>(gate);
  if (hash) {
    std::vector<int32_t> ids(size_t(kVocab) * c.K);
    for (int32_t& e : ids) e = int32_t(rng() % c.E);
    w.tid2eid = DeviceBuffer<int32_t>(ids);
    w.vocab = kVocab;
    w.hash_top_k = c.K;
  } else {
    std::vector<float> bias(c.E);
    for (float& b : bias) b = 0.05f * nd(rng);
    w.bias = DeviceBuffer<float>(bias);
  }
  return w;
}

std::unique_ptr<Case> make_case(const Config& c, bool hash, int m, int copies) {
  auto k = std::make_unique<Case>();
  std::mt19937 rng(1000u + uint32_t(m));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int i = 0; i < copies; ++i) k->w.push_back(make_weights(c, hash, rng));
  std::vector<uint16_t> x(size_t(m) * c.dim);
  for (uint16_t& v : x) v = float_to_bf16(nd(rng));
  std::vector<int32_t> tokens(m);
  for (int32_t& t : tokens) t = int32_t(rng() % kVocab);
  k->x = DeviceBuffer<uint16_t>(x);
  k->y = DeviceBuffer<uint16_t>(size_t(m) * c.dim);
  k->tokens = DeviceBuffer<int32_t>(tokens);
  const size_t bytes = cm::moe_workspace_bytes(k->w[0], m, c.K);
  k->ws = DeviceBuffer<uint8_t>(bytes);
  cm::MoeArgs& a = k->args;
  a.x = reinterpret_cast<const __nv_bfloat16*>(k->x.data());
  a.tokens = hash ? k->tokens.data() : nullptr;
  a.y = reinterpret_cast<__nv_bfloat16*>(k->y.data());
  a.m = m;
  a.p = {c.K, ScoreFunc::kSqrtSoftplus, c.route_scale, 10.0f};
  a.workspace = k->ws.data();
  a.workspace_bytes = bytes;
  return k;
}

bool wanted(const std::vector<std::string>& filters, const Config& c, bool hash, int m) {
  for (const std::string& f : filters) {
    const bool hit = f == c.name || f == (hash ? "hash" : "score") ||
                     f == "m" + std::to_string(m) || (f == "decode" && m <= 128);
    if (!hit) return false;
  }
  return true;
}

void run_case(const Config& c, bool hash, int m) {
  const size_t gate_bytes = size_t(c.E) * c.dim * 2;
  const int copies = std::min(bench::rotation_copies(gate_bytes), 32);
  const std::unique_ptr<Case> k = make_case(c, hash, m, copies);
  const std::string shape = cat(c.name, " E=", c.E, " K=", c.K, " dim=", c.dim, " M=", m,
                                hash ? " hash" : " score", " logits=", cm::router_kernel_name(m),
                                " fused_select_plan=", cm::route_plan_fused(m, c.E) ? 1 : 0);
  const int iters = m >= 4096 ? 20 : 100;
  auto time_stages = [&](unsigned stages, cm::RouterPath path, int mma_rows = 0) {
    bench::GraphSet g(copies, [&](int i, cudaStream_t s) {
      cm::MoeArgs a = k->args;
      a.stages = stages;
      a.router_path = path;
      a.router_mma_rows = mma_rows;
      a.stream = s;
      cm::moe_forward(k->w[size_t(i)], a);
    });
    return g.median_us(iters);
  };
  const std::string tag = cat(c.name, hash ? "_hash" : "_score");
  auto emit = [&](const std::string& kernel, const std::string& sh, double us) {
    bench::Result r;
    r.kernel = kernel;
    r.shape = sh;
    r.us = us;
    r.bytes = double(gate_bytes);
    r.flops = 2.0 * m * c.E * c.dim;
    r.emit();
  };
  emit("moe_router_" + tag, shape,
       time_stages(cm::kStageRoute | cm::kStagePlan, cm::RouterPath::kAuto));
  // The route stage alone with each logits kernel forced (the gemv kernel up to 256 rows).
  for (cm::RouterPath path :
       {cm::RouterPath::kGemv, cm::RouterPath::kMma, cm::RouterPath::kTiled}) {
    if (path == cm::RouterPath::kGemv && m > 256) continue;
    emit(cat("moe_router_only_", cm::router_path_name(path), "_", tag),
         cat(c.name, " E=", c.E, " K=", c.K, " dim=", c.dim, " M=", m, hash ? " hash" : " score",
             " logits=", cm::router_kernel_name(m, path)),
         time_stages(cm::kStageRoute, path));
  }
  // The fp64 MMA kernel at each tile height (8 rows x up to 32 experts, 16 x 32) where both apply.
  if (m > 32 && m <= 512)
    for (int rows : {8, 16})
      emit(cat("moe_router_only_mma", rows, "_", tag),
           cat(c.name, " E=", c.E, " K=", c.K, " dim=", c.dim, " M=", m, hash ? " hash" : " score",
               " logits=router_mma<", rows, "x32>"),
           time_stages(cm::kStageRoute, cm::RouterPath::kMma, rows));
}

}  // namespace
}  // namespace dsv4

int main(int argc, char** argv) {
  using namespace dsv4;
  try {
    const std::vector<std::string> filters(argv + 1, argv + argc);
    const std::vector<Config> configs = {real_router("flash"), real_router("pro")};
    std::fprintf(stderr, "moe_router_bench on %s\n", bench::gpu_name().c_str());
    for (const Config& c : configs)
      for (bool hash : {false, true})
        for (int m : {1, 8, 32, 128, 512, 4096})
          if (wanted(filters, c, hash, m)) run_case(c, hash, m);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_router_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
