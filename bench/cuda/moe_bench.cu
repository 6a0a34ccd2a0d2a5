// MoE layer benchmark: dsv4's grouped W4A16 MoE (router, grouping, FP4 expert GEMMs, combine)
// vs cuBLAS BF16 running the same selected experts one by one (w13 fused [2*inter, dim], then
// w2; dequantised = BF16 weights of the same shapes; GEMMs only, no routing/SwiGLU), in the
// same run. Shapes: V4-Flash (256 experts, top-6, dim 4096, inter 2048), V4-Pro (384, top-6,
// 7168, 3072) as real_config.h reads them, and the golden sets' expert counts (tiny-flash 16 /
// top-4, tiny-pro 24 / top-6, at their dim 256 / inter 128), tokens per layer M = 1 to 8192; MXFP4
// and NVFP4.
//
// Lines (bench_util.h JSON): moe_layer_<fmt> (all stages), launch_floor (as many empty
// kernels, for layers below the bandwidth-target sizes), moe_experts_<fmt> (gate/up GEMM +
// act quant + down GEMM), moe_stage_<stage>_<fmt> (route_plan, gateup, quantact, down,
// combine alone; route_plan's bytes are the gate weight), then the two expert-GEMM paths side
// by side on the same selections, each re-planned for its own token tile:
// moe_experts_{stream,streamsq,tiled}_<fmt>, moe_gemm_{gateup,down}_{stream,streamsq,tiled}_<fmt>
// (TBps = the
// selected experts' checkpoint bytes per second). Effective bytes = the
// checkpoint bytes of the experts actually selected (4.25 bits/weight MXFP4, 4.5 NVFP4);
// FLOPs = 2 * unique (token, expert) pairs * 3 * dim * inter; ceiling: BF16 tensor rate.
//
// Usage: moe_bench [filter ...]; filters name configs (flash, pro, golden16, golden24), formats
// (mxfp4, nvfp4) or token counts (m1 ... m8192, or "decode": up to 128). A case runs when, for
// each of the three kinds that any filter names, one of those filters names it ("flash nvfp4
// m512 m1024": both token counts of Flash NVFP4). An unknown filter is an error.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"
#include "cuda/bench_util.h"
#include "cuda/cublas_check.h"
#include "cuda/real_config.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/moe/moe.h"
#include "support/host_tensors.h"

namespace dsv4 {
namespace {

namespace cm = cuda::moe;
using cuda::DeviceBuffer;

struct Config {
  const char* name;
  int E, K, dim, inter;
  float route_scale;
};

// A real model's routed experts (real_config.h); the expert format is the run's, not the file's.
Config real_moe(const char* name) {
  const ModelConfig c = bench::real_config(name, false);
  return {name, c.n_routed_experts, c.n_activated_experts, c.dim, c.moe_inter_dim, c.route_scale};
}

// The measured configs: the real models, then the golden sets' expert counts (synthetic widths).
std::vector<Config> moe_configs() {
  return {
      real_moe("flash"),
      real_moe("pro"),
      {"golden16", 16, 4, 256, 128, 1.5f},
      {"golden24", 24, 6, 256, 128, 2.5f},
  };
}

// Host tensors of a layer: `distinct` random experts referenced cyclically by all E (the
// device gets E separately packed copies; values do not matter for timing).
struct HostLayer {
  test::HostTensors t;
  MoeRef ref;
};

std::vector<uint8_t> random_bytes(size_t n, uint64_t& state, uint8_t lo = 0, uint8_t span = 0) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; i += 8) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    for (size_t j = 0; j < 8 && i + j < n; ++j) {
      const uint8_t b = uint8_t(state >> (8 * j));
      v[i + j] = span ? uint8_t(lo + b % span) : b;
    }
  }
  return v;
}

std::unique_ptr<HostLayer> make_layer(const Config& c, ExpertFormat f) {
  auto h = std::make_unique<HostLayer>();
  const int distinct = std::min(c.E, 8);
  uint64_t st = 0x9e3779b97f4a7c15ull;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(c.dim)));
  std::vector<uint16_t> gate(size_t(c.E) * c.dim);
  for (uint16_t& g : gate) g = float_to_bf16(nd(rng));
  h->ref.gate = h->t.add("gate", DType::kBF16, {c.E, c.dim}, test::as_bytes(gate));
  std::vector<float> bias(c.E, 0.0f);
  h->ref.bias = h->t.add("bias", DType::kF32, {c.E}, test::as_bytes(bias));
  std::vector<ExpertRef> uniq;
  for (int e = 0; e < distinct; ++e) {
    ExpertRef x;
    auto proj = [&](const std::string& n, int out, int in) {
      Fp4Ref r;
      r.format = f;
      r.weight = h->t.add(n, DType::kU8, {out, in / 2}, random_bytes(size_t(out) * in / 2, st));
      if (f == ExpertFormat::kMxfp4) {
        r.scale = h->t.add(n + ".s", DType::kF8E8M0, {out, in / 32},
                           random_bytes(size_t(out) * in / 32, st, 115, 6));
      } else {
        r.scale = h->t.add(n + ".s", DType::kF8E4M3, {out, in / 16},
                           random_bytes(size_t(out) * in / 16, st, 0x30, 16));
        std::vector<uint8_t> g(4);
        const float s2 = 1.37e-3f;
        std::memcpy(g.data(), &s2, 4);
        r.scale_2 = h->t.add(n + ".s2", DType::kF32, {}, std::move(g));
      }
      return r;
    };
    x.w1 = proj("w1", c.inter, c.dim);
    x.w3 = proj("w3", c.inter, c.dim);
    x.w2 = proj("w2", c.dim, c.inter);
    uniq.push_back(x);
  }
  for (int e = 0; e < c.E; ++e) h->ref.experts.push_back(uniq[e % distinct]);
  return h;
}

__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = __float2bfloat16_rn((float(h & 0xffff) / 65536.0f - 0.5f) * scale);
  }
}
__global__ void empty_kernel() {
  cuda::sm90::griddep_wait();
  cuda::sm90::griddep_launch_dependents();
}

// The launch floor: `n` empty kernels back to back on the stream, launched as the MoE stages
// are (programmatic dependent launch).
double launch_floor_us(int n, cudaStream_t stream) {
  return bench::median_us(
      [&](int) {
        for (int i = 0; i < n; ++i) {
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(1);
          cfg.blockDim = dim3(32);
          cfg.stream = stream;
          cudaLaunchAttribute attr[1];
          attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          attr[0].val.programmaticStreamSerializationAllowed = 1;
          cfg.attrs = attr;
          cfg.numAttrs = 1;
          DSV4_CUDA_CHECK(cudaLaunchKernelEx(&cfg, empty_kernel));
        }
      },
      50, 5);
}

void fill(__nv_bfloat16* p, size_t n, uint32_t seed, float scale = 0.05f) {
  if (n) fill_bf16<<<1024, 256>>>(p, n, seed, scale);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

// One rotation copy: inputs, outputs and workspace of one moe_forward.
struct Copy {
  DeviceBuffer<__nv_bfloat16> x, shared, y;
  DeviceBuffer<uint8_t> ws;
  cm::MoeArgs args;
  int pairs = 0, active = 0;
  std::vector<int32_t> first;  // expert_first
};

struct Peer {  // cuBLAS BF16 weights of every expert, activations for the largest case
  DeviceBuffer<__nv_bfloat16> w13, w2, x, a, y1, y2;
};

bool is_m_filter(const std::string& f) {
  return f == "decode" ||
         (f.size() > 1 && f[0] == 'm' && f.find_first_not_of("0123456789", 1) == std::string::npos);
}

bool wanted(const std::vector<std::string>& filters, const std::string& cfg, const std::string& fmt,
            int m) {
  bool any_cfg = false, cfg_ok = false, any_fmt = false, fmt_ok = false, any_m = false,
       m_ok = false;
  for (const std::string& f : filters) {
    if (f == "mxfp4" || f == "nvfp4") {
      any_fmt = true;
      fmt_ok |= f == fmt;
    } else if (is_m_filter(f)) {
      any_m = true;
      m_ok |= f == "m" + std::to_string(m) || (f == "decode" && m <= 128);
    } else {
      any_cfg = true;
      cfg_ok |= f == cfg;
    }
  }
  return (!any_cfg || cfg_ok) && (!any_fmt || fmt_ok) && (!any_m || m_ok);
}

void run_config(const Config& c, ExpertFormat f, const std::vector<int>& ms,
                const std::vector<std::string>& filters, cublasHandle_t blas, cudaStream_t stream) {
  const std::string fmt = f == ExpertFormat::kMxfp4 ? "mxfp4" : "nvfp4";
  std::vector<int> todo;
  for (int m : ms)
    if (wanted(filters, c.name, fmt, m)) todo.push_back(m);
  if (todo.empty()) return;
  auto host = make_layer(c, f);
  const cm::MoeDeviceWeights w = cm::upload_moe_weights(host->ref);
  host.reset();
  const double expert_bytes = w.expert_checkpoint_bytes();

  Peer peer;
  const size_t w13n = size_t(2) * c.inter * c.dim, w2n = size_t(c.dim) * c.inter;
  peer.w13 = DeviceBuffer<__nv_bfloat16>(w13n * c.E);
  peer.w2 = DeviceBuffer<__nv_bfloat16>(w2n * c.E);
  fill(peer.w13.data(), peer.w13.size(), 1);
  fill(peer.w2.data(), peer.w2.size(), 2);
  const size_t max_pairs = size_t(*std::max_element(todo.begin(), todo.end())) * c.K;
  peer.x = DeviceBuffer<__nv_bfloat16>(max_pairs * c.dim);
  peer.a = DeviceBuffer<__nv_bfloat16>(max_pairs * c.inter);
  peer.y1 = DeviceBuffer<__nv_bfloat16>(max_pairs * 2 * c.inter);
  peer.y2 = DeviceBuffer<__nv_bfloat16>(max_pairs * c.dim);
  fill(peer.x.data(), peer.x.size(), 3);
  fill(peer.a.data(), peer.a.size(), 4);

  for (int m : todo) {
    // Rotation copies: different tokens select different experts, so small M streams
    // experts from HBM rather than L2.
    const int copies = m <= 4 ? 8 : 1;
    std::vector<std::unique_ptr<Copy>> cp;
    const int tile_n = cm::moe_default_tile_n(w, m, c.K);
    for (int i = 0; i < copies; ++i) {
      auto k = std::make_unique<Copy>();
      k->x = DeviceBuffer<__nv_bfloat16>(size_t(m) * c.dim);
      k->shared = DeviceBuffer<__nv_bfloat16>(size_t(m) * c.dim);
      k->y = DeviceBuffer<__nv_bfloat16>(size_t(m) * c.dim);
      fill(k->x.data(), k->x.size(), 100 + i, 4.0f);  // router scores vary across tokens
      fill(k->shared.data(), k->shared.size(), 200 + i);
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      const size_t bytes = cm::moe_workspace_bytes(w, m, c.K);
      k->ws = DeviceBuffer<uint8_t>(bytes);
      cm::MoeArgs& a = k->args;
      a.x = k->x.data();
      a.shared = k->shared.data();
      a.y = k->y.data();
      a.m = m;
      a.p = {c.K, ScoreFunc::kSqrtSoftplus, c.route_scale, 10.0f};
      a.workspace = k->ws.data();
      a.workspace_bytes = bytes;
      a.stream = stream;
      cm::moe_forward(w, a);
      DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
      const cm::MoeWorkspace ws = cm::carve_moe_workspace(w, m, c.K, k->ws.data());
      int32_t cnt[3];
      DSV4_CUDA_CHECK(cudaMemcpy(cnt, ws.counters, sizeof cnt, cudaMemcpyDeviceToHost));
      if (cnt[2] != 0) throw Error(cat("moe_bench: device error flags ", cnt[2]));
      k->pairs = cnt[0];
      k->first.resize(c.E + 1);
      DSV4_CUDA_CHECK(
          cudaMemcpy(k->first.data(), ws.expert_first, (c.E + 1) * 4, cudaMemcpyDeviceToHost));
      for (int e = 0; e < c.E; ++e) k->active += k->first[e + 1] > k->first[e];
      cp.push_back(std::move(k));
    }
    double active = 0, pairs = 0;
    for (auto& k : cp) active += k->active, pairs += k->pairs;
    active /= copies, pairs /= copies;
    const double bytes = active * expert_bytes;
    const double flops = 2.0 * pairs * 3.0 * c.dim * c.inter;
    const int iters = m >= 4096 ? 20 : 50;

    auto time_stages = [&](unsigned stages) {
      return bench::median_us(
          [&](int i) {
            cm::MoeArgs a = cp[i % copies]->args;
            a.stages = stages;
            cm::moe_forward(w, a);
          },
          iters, 3);
    };
    // The peer: the same experts with the same token counts, one cuBLAS GEMM pair each.
    auto peer_run = [&](int i) {
      const Copy& k = *cp[i % copies];
      const float alpha = 1.0f, beta = 0.0f;
      for (int e = 0; e < c.E; ++e) {
        const int me = k.first[e + 1] - k.first[e];
        if (!me) continue;
        const size_t off = size_t(k.first[e]);
        CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, 2 * c.inter, me, c.dim, &alpha,
                                  peer.w13.data() + e * w13n, CUDA_R_16BF, c.dim,
                                  peer.x.data() + off * c.dim, CUDA_R_16BF, c.dim, &beta,
                                  peer.y1.data() + off * 2 * c.inter, CUDA_R_16BF, 2 * c.inter,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, c.dim, me, c.inter, &alpha,
                                  peer.w2.data() + e * w2n, CUDA_R_16BF, c.inter,
                                  peer.a.data() + off * c.inter, CUDA_R_16BF, c.inter, &beta,
                                  peer.y2.data() + off * c.dim, CUDA_R_16BF, c.dim,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
    };
    const double peer_us = bench::median_us(peer_run, iters, 3);
    const std::string shape =
        cat(c.name, " E=", c.E, " K=", c.K, " dim=", c.dim, " inter=", c.inter, " M=", m,
            " tile_n=", tile_n, " active=", active, " pairs=", pairs);
    auto emit = [&](const std::string& kernel, double us, double b, double fl, bool with_peer) {
      bench::Result r;
      r.kernel = kernel;
      r.shape = shape;
      r.us = us;
      r.bytes = b;
      r.flops = fl;
      r.tensor_rate_tflops = bench::kBf16Tflops;
      if (with_peer) r.peer = "cublas_bf16_per_expert", r.peer_us = peer_us;
      r.emit();
    };
    emit("moe_layer_" + fmt, time_stages(cm::kStageAll), bytes, flops, true);
    {  // what the same number of launches costs with nothing in them
      const int launches = cm::moe_launch_count(w, m, c.K);
      bench::Result r;
      r.kernel = "launch_floor";
      r.shape = cat(shape, " launches=", launches);
      r.us = launch_floor_us(launches, stream);
      r.emit();
    }
    emit("moe_experts_" + fmt, time_stages(cm::kStageGateUp | cm::kStageQuantAct | cm::kStageDown),
         bytes, flops, true);
    // Router logits + selection + x quantisation + grouping (fused for decode batches).
    emit("moe_stage_route_plan_" + fmt, time_stages(cm::kStageRoute | cm::kStagePlan),
         2.0 * c.E * c.dim, 2.0 * m * c.E * c.dim, false);
    emit("moe_stage_gateup_" + fmt, time_stages(cm::kStageGateUp), bytes * 2 / 3, flops * 2 / 3,
         false);
    if (!cm::moe_fuses_act_quant(cm::moe_gemm_choice(w, m, c.K)))  // else in the down GEMM
      emit("moe_stage_quantact_" + fmt, time_stages(cm::kStageQuantAct), 4.0 * pairs * c.inter, 0,
           false);
    emit("moe_stage_down_" + fmt, time_stages(cm::kStageDown), bytes / 3, flops / 3, false);
    emit("moe_stage_combine_" + fmt, time_stages(cm::kStageCombine),
         2.0 * (pairs + 2.0 * m) * c.dim, 0, false);

    // The expert GEMM paths side by side: each copy re-planned for the path's token tile
    // (the tile list depends on it), then its GEMM stages timed, at every M (the stream path
    // re-streams an expert's weights for every 16 of its rows: where that stops paying is what
    // kStreamAutoMaxRowsPerExpert is read from).
    // "stream" quantises the down GEMM's activations inside it, "streamsq" in the separate
    // launch (counted in moe_experts_streamsq, not in moe_gemm_down_streamsq).
    // "streamsq8": the stream path held to 8-token tiles where the default takes 16 (an expert
    // with more rows is streamed twice, a tile carries half the MMA work).
    // "tiled256": the tiled GEMM forced to its 256-token tile, "tiled_ws256" / "tiled_ws128" the
    // 256 / 128 tiles warp-specialised (moe_gemm_ws.cuh) -- none the heuristic's pick until
    // measured faster than the plain 128 tile.
    struct Variant {
      cm::MoeGemmPath path;
      cm::MoeDownQuant quant;
      int tile_n;
      const char* name;
    };
    for (const Variant& v :
         {Variant{cm::MoeGemmPath::kStream, cm::MoeDownQuant::kInDown, 0, "stream"},
          Variant{cm::MoeGemmPath::kStream, cm::MoeDownQuant::kSeparate, 0, "streamsq"},
          Variant{cm::MoeGemmPath::kStream, cm::MoeDownQuant::kSeparate, 8, "streamsq8"},
          Variant{cm::MoeGemmPath::kTiled, cm::MoeDownQuant::kAuto, 0, "tiled"},
          Variant{cm::MoeGemmPath::kTiled, cm::MoeDownQuant::kAuto, 256, "tiled256"},
          Variant{cm::MoeGemmPath::kTiledWs, cm::MoeDownQuant::kAuto, 0, "tiled_ws256"},
          Variant{cm::MoeGemmPath::kTiledWs, cm::MoeDownQuant::kAuto, 128, "tiled_ws128"}}) {
      if (v.tile_n && v.tile_n == cm::moe_gemm_choice(w, m, c.K, v.path, 0, v.quant).tile_n)
        continue;  // the same as the variant without a forced tile
      const std::string pn = v.name;
      const cm::MoeGemmChoice gc = cm::moe_gemm_choice(w, m, c.K, v.path, v.tile_n, v.quant);
      for (auto& k : cp) {
        k->args.gemm_path = v.path;
        k->args.down_quant = v.quant;
        k->args.tile_n = v.tile_n;
        cm::moe_forward(w, k->args);
      }
      DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
      auto emit_path = [&](const std::string& kernel, unsigned stages, double b, double fl) {
        bench::Result r;
        r.kernel = kernel + "_" + pn + "_" + fmt;
        r.shape = cat(shape, " path=", pn, " path_tile_n=", gc.tile_n);
        r.us = time_stages(stages);
        r.bytes = b;
        r.flops = fl;
        r.tensor_rate_tflops = bench::kBf16Tflops;
        r.emit();
      };
      emit_path("moe_experts", cm::kStageGateUp | cm::kStageQuantAct | cm::kStageDown, bytes,
                flops);
      emit_path("moe_gemm_gateup", cm::kStageGateUp, bytes * 2 / 3, flops * 2 / 3);
      emit_path("moe_gemm_down", cm::kStageDown, bytes / 3, flops / 3);
    }
    for (auto& k : cp) {
      k->args.gemm_path = cm::MoeGemmPath::kAuto;
      k->args.down_quant = cm::MoeDownQuant::kAuto;
      k->args.tile_n = 0;
    }
  }
}

}  // namespace
}  // namespace dsv4

int main(int argc, char** argv) {
  using namespace dsv4;
  try {
    std::vector<std::string> filters(argv + 1, argv + argc);
    const std::vector<Config> configs = moe_configs();
    const std::vector<int> ms = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
    for (const std::string& f : filters) {
      bool known = f == "mxfp4" || f == "nvfp4" || f == "decode";
      for (const Config& c : configs) known |= f == c.name;
      for (int m : ms) known |= f == "m" + std::to_string(m);
      if (!known)
        throw Error(cat("unknown filter '", f, "' (see the usage at the top of moe_bench.cu)"));
    }
    // A blocking stream: bench_util's events on the legacy stream order against it, and the
    // MoE stages use programmatic dependent launch on it as the engine would.
    cudaStream_t stream;
    DSV4_CUDA_CHECK(cudaStreamCreate(&stream));
    cublasHandle_t blas;
    CUBLAS_CHECK(cublasCreate(&blas));
    CUBLAS_CHECK(cublasSetStream(blas, stream));
    std::fprintf(stderr, "moe_bench on %s\n", bench::gpu_name().c_str());
    for (const Config& c : configs)
      for (ExpertFormat f : {ExpertFormat::kMxfp4, ExpertFormat::kNvfp4})
        run_config(c, f, ms, filters, blas, stream);
    cublasDestroy(blas);
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
