// FP8 block-scaled GEMM and head logits at DeepSeek-V4 Flash and Pro shapes (real_config.h), side
// by side in the same run with cuBLAS BF16 (cublasGemmEx on the dequantised weight) and cuBLASLt
// FP8 (per-tensor scale) on the same shapes. Weights are rotated through more memory than the L2
// holds.
//
// One JSON line per (kernel, shape): µs, TFLOPS, TB/s on the weight bytes, the roofline
// max(weight bytes / 4.3 TB/s, flops / tensor rate) and the fraction of it reached.
//   kernel "fp8_gemm"            : our GEMM on pre-quantised activations (peer: cuBLASLt FP8)
//   kernel "fp8_linear"          : activation quantisation + GEMM (peer: cuBLAS BF16)
//   kernel "act_quant"           : the quantisation kernel alone (bytes: BF16 in + e4m3 out)
//   kernel "cublas_bf16" / "cublaslt_fp8_per_tensor": the peers with their own rooflines
//   kernel "head_logits"         : our head (peer: cuBLAS BF16 -> fp32)
//   kernel "fp8_gemm_grouped"    : the engine's pairs of weights on one input through
//                                  fp8_gemm_grouped (wq_a + wkv, wq_b + indexer wq_b; one launch
//                                  or two as the grouping rule says; peer: the two fp8_gemm
//                                  launches one after the other)
//   kernel "fp8_gemm_grouped[one launch]": the pair forced into one launch at the planned split
//   kernel "fp8_gemm[old split]" / "fp8_gemm_grouped[old split]": the same kernel at the split
//                                  the 740a4a4 heuristic chose (per-CTA steps, no bandwidth),
//                                  where it differs (peer: the new plan's time)
//   kernel "fp8_gemm[stream]" / "fp8_gemm[tensorcore]": m 65..256, both paths forced (peer: the
//                                  other one), whichever the heuristic picked is "fp8_gemm"
//   kernel "stream_split"        : --sweep: one weight at every K split in --splits (the rows the
//                                  cost model of fp8_gemm_heuristic.h is fitted to)
// Every shape string names the plan: "path=stream splits=S" or "path=tensorcore".
// Usage: gemm_bench [--model flash|pro|all] [--m 1,4,16] [--iters N] [--no-head] [--grouped]
//                   [--sweep] [--splits 1,2,4,8,16]
//   --grouped: only the grouped pairs (and their separate launches)
//   --sweep: only the split sweep of every weight of the model(s) at each m
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/bench_util.h"
#include "cuda/cublas_check.h"
#include "cuda/device_fill.cuh"
#include "cuda/real_config.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/gemm/fp8_gemm.h"
#include "ops/cuda/gemm/fp8_gemm_heuristic.h"
#include "ops/cuda/gemm/fp8_gemm_prefill.h"
#include "ops/cuda/gemm/stream_gemm.h"
#include "ops/cuda/head/head.h"

using namespace dsv4;
using namespace dsv4::cuda;

namespace {

struct Shape {
  const char* name;
  int n, k;
};

void fill_bytes(void* p, size_t n, uint32_t seed, uint8_t mask = 0x77) {
  bench::fill_bytes_kernel<<<1024, 256>>>(static_cast<uint8_t*>(p), n, seed, mask);
}
void fill_bf16(void* p, size_t n, uint32_t seed) {
  bench::fill_bf16_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed, 1e-3f);
}

struct Options {
  bool flash = true, pro = true, head = true, grouped_only = false, sweep = false;
  std::vector<int> ms = {1, 4, 16, 64, 256, 4096};
  std::vector<int> splits = {1, 2, 4, 8, 16};
  int iters = 30;
};

std::vector<int> int_list(char* arg) {
  std::vector<int> v;
  for (char* t = std::strtok(arg, ","); t; t = std::strtok(nullptr, ",")) v.push_back(std::atoi(t));
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) {
      const std::string m = argv[++i];
      o.flash = m == "flash" || m == "all";
      o.pro = m == "pro" || m == "all";
    } else if (a == "--m" && i + 1 < argc) {
      o.ms = int_list(argv[++i]);
    } else if (a == "--splits" && i + 1 < argc) {
      o.splits = int_list(argv[++i]);
    } else if (a == "--sweep") {
      o.sweep = true;
    } else if (a == "--iters" && i + 1 < argc) {
      o.iters = std::atoi(argv[++i]);
    } else if (a == "--no-head") {
      o.head = false;
    } else if (a == "--grouped") {
      o.grouped_only = true;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--model flash|pro|all] [--m 1,4,16] [--iters N] [--no-head] "
                   "[--grouped] [--sweep] [--splits 1,2,4,8,16]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  return o;
}

// cuBLASLt FP8 e4m3 x e4m3 -> BF16 with per-tensor scales (the anchors' torch._scaled_mm), or
// with the checkpoint's block scales (weights 128x128, activations 1x128, fp32: cuBLASLt's
// BLK128x128_32F / VEC128_32F modes) where both scale pointers are given (timed only: its
// numerics are not checked here).
struct LtFp8 {
  cublasLtHandle_t lt = nullptr;
  DeviceBuffer<uint8_t> ws{64 << 20};
  DeviceBuffer<float> one{1};
  LtFp8() {
    CUBLAS_CHECK(cublasLtCreate(&lt));
    bench::fill_f32_const_kernel<<<1, 32>>>(one.data(), 1, 1.0f);
  }
  ~LtFp8() { cublasLtDestroy(lt); }

  // y[m, n] = x[m, k] w[n, k]^T, column-major view: Y^T (n x m) = W (n x k) . X^T (k x m).
  // Returns false when cuBLASLt offers no algorithm for the shape.
  bool run(const uint8_t* w, const uint8_t* x, __nv_bfloat16* y, int m, int n, int k,
           cudaStream_t s, const float* w_scales = nullptr, const float* x_scales = nullptr) {
    cublasLtMatmulDesc_t op;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const bool blocks = w_scales && x_scales;
    const float* sa = blocks ? w_scales : one.data();
    const float* sb = blocks ? x_scales : one.data();
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb));
    if (blocks) {
      const cublasLtMatmulMatrixScale_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                        mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      if (cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma) !=
              CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb) !=
              CUBLAS_STATUS_SUCCESS) {
        cublasLtMatmulDescDestroy(op);
        return false;
      }
    }
    cublasLtMatrixLayout_t la, lb, lc;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, n, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, m, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, m, n));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t wsb = ws.size();
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    cublasLtMatmulHeuristicResult_t h{};
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &h, &found);
    bool ok = found > 0;
    if (ok) {
      const float alpha = 1.0f, beta = 0.0f;
      ok = cublasLtMatmul(lt, op, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &h.algo, ws.data(),
                          wsb, s) == CUBLAS_STATUS_SUCCESS;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
    return ok;
  }
};

void emit(const std::string& kernel, const std::string& shape, double us, double flops,
          double bytes, double rate, const std::string& peer, double peer_us) {
  bench::Result r;
  r.kernel = kernel;
  r.shape = shape;
  r.us = us;
  r.flops = flops;
  r.bytes = bytes;
  r.tensor_rate_tflops = rate;
  r.peer = peer;
  r.peer_us = peer_us;
  r.emit();
}

int tiles_of(int n) {
  return (n + cuda::gemm_cfg::kStreamRows - 1) / cuda::gemm_cfg::kStreamRows;
}

// The K split the 740a4a4 heuristic chose (a per-CTA step model, two steps of start-up a CTA,
// no bandwidth), kept here to time the old choice on the same kernel.
int old_split(int tiles, int k_steps, const cuda::StreamResidency& res) {
  double best = 1e30;
  int split = 1;
  const int top = std::min({cuda::gemm_cfg::kStreamMaxSplits, res.max_splits, k_steps});
  for (int s = 1; s <= top; ++s) {
    const int slots = res.resident[s];
    if (slots < s) continue;
    const int waves = (tiles * s + slots - 1) / slots, per = (k_steps + s - 1) / s;
    const double cost = double(waves) * (per + 2.0) + (s > 1 ? 1.0 + s / 16.0 : 0.0);
    if (cost < best - 1e-9) {
      best = cost;
      split = s;
    }
  }
  return split;
}

int new_split(int tiles, int k) {
  return cuda::plan_stream_tiles(1, tiles, k / 128, cuda::detail::stream_residency_fp8()).splits;
}

// The plan of one weight at m, as the shape string names it.
std::string plan_of(int m, int n, int k) {
  if (cuda::fp8_gemm_pick_path(m, n, k) != cuda::Fp8GemmPath::kStream) return " path=tensorcore";
  return " path=stream splits=" + std::to_string(new_split(tiles_of(n), k));
}

// Quantised activations [m, k] (random BF16 through quantize_act_fp8).
struct BenchAct {
  DeviceBuffer<uint16_t> x;
  DeviceBuffer<uint8_t> codes;
  DeviceBuffer<float> scales;
  int m, k, ld;
  BenchAct(int m_, int k_)
      : x(size_t(m_) * k_),
        codes(size_t(m_) * k_),
        scales(size_t(k_ / 128) * fp8_scale_ld(m_)),
        m(m_),
        k(k_),
        ld(fp8_scale_ld(m_)) {
    fill_bf16(x.data(), x.size(), 3);
    quantize_act_fp8(quant(), nullptr);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ActQuantParams quant() const {
    ActQuantParams q;
    q.x = reinterpret_cast<const __nv_bfloat16*>(x.data());
    q.m = m;
    q.k = k;
    q.codes = const_cast<uint8_t*>(codes.data());
    q.scales_t = const_cast<float*>(scales.data());
    q.ld_scales = ld;
    return q;
  }
  Fp8GemmParams gemm(const Fp8WeightView& w, void* y) const {
    Fp8GemmParams g;
    g.a_codes = codes.data();
    g.a_scales_t = scales.data();
    g.a_ld_scales = ld;
    g.m = m;
    g.w = w;
    g.y = static_cast<__nv_bfloat16*>(y);
    return g;
  }
};

// `copies` random FP8 weights [n, k] (the rotation through more memory than the L2 holds).
struct BenchWeights {
  std::vector<DeviceBuffer<uint8_t>> codes;
  std::vector<DeviceBuffer<float>> scales;
  int n, k;
  BenchWeights(int n_, int k_, int copies, uint32_t seed) : n(n_), k(k_) {
    for (int c = 0; c < copies; ++c) {
      codes.emplace_back(size_t(n) * k);
      fill_bytes(codes.back().data(), codes.back().size(), seed + 2 * c);
      scales.emplace_back(size_t(k / 128) * tiles_of(n));
      bench::fill_f32_const_kernel<<<64, 256>>>(scales.back().data(), scales.back().size(),
                                                1.0f / 64);
    }
  }
  Fp8WeightView view(int c) const { return {codes[c].data(), scales[c].data(), n, k}; }
};

// One grouped call (weights `ws` at rotation copy c into ys) at `splits` (0: automatic).
void grouped_call(const BenchAct& a, const std::vector<const BenchWeights*>& ws,
                  std::vector<DeviceBuffer<uint16_t>>& ys, int c, int splits, void* work,
                  size_t work_bytes, cudaStream_t st) {
  Fp8GemmGroupedParams g;
  g.a_codes = a.codes.data();
  g.a_scales_t = a.scales.data();
  g.a_ld_scales = a.ld;
  g.m = a.m;
  g.count = int(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    g.w[i] = ws[i]->view(c);
    g.y[i] = reinterpret_cast<__nv_bfloat16*>(ys[i].data());
  }
  g.workspace = work;
  g.workspace_bytes = work_bytes;
  g.splits = splits;
  fp8_gemm_grouped(g, st);
}

void bench_linear(const char* model, const Shape& s, int m, const Options& o, cublasHandle_t cb,
                  LtFp8& lt) {
  const int n = s.n, k = s.k;
  const size_t wbytes = size_t(n) * k;
  const int copies = bench::rotation_copies(wbytes);
  const BenchWeights w(n, k, copies, 17);
  const BenchAct a(m, k);
  DeviceBuffer<uint16_t> y(size_t(m) * n);
  const size_t gws = std::max(fp8_gemm_workspace_bytes(m, n, k),
                              fp8_gemm_workspace_bytes(m, n, k, Fp8GemmPath::kTensorCore));
  const size_t lws = fp8_linear_workspace_bytes(m, n, k);
  DeviceBuffer<uint8_t> gw(std::max<size_t>(gws, 16)), lw(std::max<size_t>(lws, 16));
  auto by = reinterpret_cast<__nv_bfloat16*>(y.data());

  const double flops = 2.0 * m * n * double(k);
  const std::string shape = std::string(model) + " " + s.name + " m=" + std::to_string(m) +
                            " n=" + std::to_string(n) + " k=" + std::to_string(k);
  const ActQuantParams q = a.quant();
  const double t_quant =
      bench::GraphSet(1, [&](int, cudaStream_t st) { quantize_act_fp8(q, st); }).median_us(o.iters);
  const auto time_gemm = [&](Fp8GemmPath path) {
    return bench::GraphSet(copies,
                           [&](int c, cudaStream_t st) {
                             Fp8GemmParams g = a.gemm(w.view(c), by);
                             g.workspace = gw.data();
                             g.workspace_bytes = gw.size();
                             g.path = path;
                             fp8_gemm(g, st);
                           })
        .median_us(o.iters);
  };
  const double t_gemm = time_gemm(Fp8GemmPath::kAuto);
  const double t_linear = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
                            Fp8LinearParams p;
                            p.x = q.x;
                            p.m = m;
                            p.w = w.view(c);
                            p.y = by;
                            p.workspace = lw.data();
                            p.workspace_bytes = lw.size();
                            fp8_linear(p, st);
                          }).median_us(o.iters);

  // cuBLASLt FP8 per-tensor on the same codes, and with the block scales (m <= 256 only: the
  // candidate for the 65..256 fast path).
  double t_lt = -1, t_lt_blocks = -1;
  if (lt.run(w.codes[0].data(), a.codes.data(), by, m, n, k, nullptr)) {
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    t_lt = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
             lt.run(w.codes[c].data(), a.codes.data(), by, m, n, k, st);
           }).median_us(o.iters);
  }
  (void)cudaGetLastError();
  if (m <= cuda::gemm_cfg::kStreamMaxM && lt.run(w.codes[0].data(), a.codes.data(), by, m, n, k,
                                                 nullptr, w.scales[0].data(), a.scales.data())) {
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    t_lt_blocks = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
                    lt.run(w.codes[c].data(), a.codes.data(), by, m, n, k, st, w.scales[c].data(),
                           a.scales.data());
                  }).median_us(o.iters);
  }
  (void)cudaGetLastError();
  // cuBLAS BF16 on a BF16 weight of the same shape (rotated separately: twice the bytes).
  const size_t wb16 = wbytes * 2;
  const int copies16 = bench::rotation_copies(wb16);
  std::vector<DeviceBuffer<uint16_t>> w16;
  for (int c = 0; c < copies16; ++c) {
    w16.emplace_back(wbytes);
    fill_bf16(w16.back().data(), wbytes, 29 + c);
  }
  const float one = 1.0f, zero = 0.0f;
  const double t_bf16 =
      bench::GraphSet(copies16, [&](int c, cudaStream_t st) {
        CUBLAS_CHECK(cublasSetStream(cb, st));
        CUBLAS_CHECK(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w16[c].data(),
                                  CUDA_R_16BF, k, a.x.data(), CUDA_R_16BF, k, &zero, y.data(),
                                  CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }).median_us(o.iters);

  const double fp8 = bench::kFp8Tflops, bf = bench::kBf16Tflops;
  const std::string planned = shape + plan_of(m, n, k);
  emit("fp8_gemm", planned, t_gemm, flops, double(wbytes), fp8, "cublaslt_fp8_per_tensor", t_lt);
  emit("fp8_linear", planned, t_linear, flops, double(wbytes), fp8, "cublas_bf16", t_bf16);
  emit("act_quant", shape, t_quant, 0, double(m) * k * 3 + double(m) * (k / 128) * 4, fp8, "", 0);
  if (t_lt > 0) emit("cublaslt_fp8_per_tensor", shape, t_lt, flops, double(wbytes), fp8, "", 0);
  if (t_lt_blocks > 0)
    emit("cublaslt_fp8_blockscaled", shape, t_lt_blocks, flops, double(wbytes), fp8, "fp8_gemm",
         t_gemm);
  emit("cublas_bf16", shape, t_bf16, flops, double(wb16), bf, "", 0);

  const bool streams = fp8_gemm_pick_path(m, n, k) == Fp8GemmPath::kStream;
  if (m > cuda::gemm_cfg::kStreamMaxTokens && m <= cuda::gemm_cfg::kStreamMaxM) {
    // Both paths at 65..256, each against the other.
    const double t_stream = streams ? t_gemm : time_gemm(Fp8GemmPath::kStream);
    const double t_tc = streams ? time_gemm(Fp8GemmPath::kTensorCore) : t_gemm;
    emit("fp8_gemm[stream]", shape + " splits=" + std::to_string(new_split(tiles_of(n), k)),
         t_stream, flops, double(wbytes), fp8, "fp8_gemm[tensorcore]", t_tc);
    emit("fp8_gemm[tensorcore]", shape, t_tc, flops, double(wbytes), fp8, "fp8_gemm[stream]",
         t_stream);
    // The tensor-core kernel's other work splits at these sizes (persistent data-parallel tiles,
    // split-K at 2..8), each against the scheduler the heuristic picked.
    if (n % 8 == 0) {
      struct Variant {
        const char* name;
        cuda::detail::PrefillScheduler sched;
        int splits;
      };
      using cuda::detail::PrefillScheduler;
      for (const Variant& v : {Variant{"persistent", PrefillScheduler::kPersistent, 0},
                               Variant{"splitk2", PrefillScheduler::kStreamK, 2},
                               Variant{"splitk4", PrefillScheduler::kStreamK, 4},
                               Variant{"splitk8", PrefillScheduler::kStreamK, 8}}) {
        cuda::detail::PrefillArgs pa;
        pa.a = a.codes.data();
        pa.a_scales_t = a.scales.data();
        pa.a_ld = a.ld;
        pa.m = m;
        pa.n = n;
        pa.k = k;
        pa.ldy = n;
        pa.y = by;
        pa.scheduler = v.sched;
        pa.splits = v.splits;
        DeviceBuffer<uint8_t> vw(std::max<size_t>(cuda::detail::prefill_workspace_bytes(pa), 16));
        const double t_v = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
                             cuda::detail::PrefillArgs pc = pa;
                             const Fp8WeightView wv = w.view(c);
                             pc.w = wv.codes;
                             pc.w_scales_t = wv.scales_t;
                             cuda::detail::prefill_gemm(pc, vw.data(), vw.size(), st);
                           }).median_us(o.iters);
        emit(std::string("fp8_gemm[tensorcore ") + v.name + "]", shape, t_v, flops, double(wbytes),
             fp8, "fp8_gemm[tensorcore]", t_tc);
      }
    }
  }
  if (streams && m <= cuda::gemm_cfg::kStreamMaxTokens) {
    // The old heuristic's split on the same kernel, where it differs.
    const int old = old_split(tiles_of(n), k / 128, cuda::detail::stream_residency_fp8());
    if (old != new_split(tiles_of(n), k)) {
      std::vector<const BenchWeights*> ws = {&w};
      std::vector<DeviceBuffer<uint16_t>> ys;
      ys.emplace_back(size_t(m) * n);
      const double t_old = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
                             grouped_call(a, ws, ys, c, old, gw.data(), gw.size(), st);
                           }).median_us(o.iters);
      emit("fp8_gemm[old split]", shape + " splits=" + std::to_string(old), t_old, flops,
           double(wbytes), fp8, "fp8_gemm", t_gemm);
    }
  }
}

// Two weights on one quantised input through fp8_gemm_grouped (one launch or two, as the rule
// says) against the two launches of fp8_gemm, and the one launch forced at the new and the old
// split.
void bench_grouped(const char* model, const Shape& sa, const Shape& sb, int m, const Options& o) {
  const int k = sa.k;
  const size_t bytes = (size_t(sa.n) + sb.n) * k;
  const int copies = bench::rotation_copies(bytes);
  const BenchWeights wa(sa.n, k, copies, 41), wb(sb.n, k, copies, 42);
  const std::vector<const BenchWeights*> ws = {&wa, &wb};
  std::vector<DeviceBuffer<uint16_t>> ys;
  size_t gws = 16;
  for (const BenchWeights* w : ws) {
    ys.emplace_back(size_t(m) * w->n);
    gws = std::max(gws, fp8_gemm_workspace_bytes(m, w->n, k));
  }
  const BenchAct a(m, k);
  DeviceBuffer<uint8_t> gw(gws);
  const auto time_grouped = [&](int splits) {
    return bench::GraphSet(copies,
                           [&](int c, cudaStream_t st) {
                             grouped_call(a, ws, ys, c, splits, gw.data(), gw.size(), st);
                           })
        .median_us(o.iters);
  };
  const double t_grouped = time_grouped(0);
  const double t_separate = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
                              for (size_t i = 0; i < ws.size(); ++i) {
                                Fp8GemmParams g = a.gemm(ws[i]->view(c), ys[i].data());
                                g.workspace = gw.data();
                                g.workspace_bytes = gw.size();
                                fp8_gemm(g, st);
                              }
                            }).median_us(o.iters);
  const double flops = 2.0 * m * (double(sa.n) + sb.n) * k;
  const std::string shape = std::string(model) + " " + sa.name + "+" + sb.name +
                            " m=" + std::to_string(m) + " n=" + std::to_string(sa.n) + "+" +
                            std::to_string(sb.n) + " k=" + std::to_string(k);
  const bool streams = fp8_gemm_pick_path(m, sa.n, k) == Fp8GemmPath::kStream &&
                       fp8_gemm_pick_path(m, sb.n, k) == Fp8GemmPath::kStream;
  const int tiles[2] = {tiles_of(sa.n), tiles_of(sb.n)};
  const cuda::StreamResidency res = cuda::detail::stream_residency_fp8();
  const bool one_launch = streams && cuda::plan_stream_grouping(tiles, 2, k / 128, res).grouped;
  const int split = new_split(tiles[0] + tiles[1], k);
  emit("fp8_gemm_grouped",
       shape + (streams ? (one_launch ? " one launch splits=" + std::to_string(split)
                                      : std::string(" two launches"))
                        : std::string(" tensorcore")),
       t_grouped, flops, double(bytes), bench::kFp8Tflops, "fp8_gemm_x2_separate", t_separate);
  if (!streams) return;
  if (!one_launch)
    emit("fp8_gemm_grouped[one launch]", shape + " splits=" + std::to_string(split),
         time_grouped(split), flops, double(bytes), bench::kFp8Tflops, "fp8_gemm_grouped",
         t_grouped);
  const int old = old_split(tiles[0] + tiles[1], k / 128, res);
  if (m <= cuda::gemm_cfg::kStreamMaxTokens && (old != split || !one_launch))
    emit("fp8_gemm_grouped[old split]", shape + " splits=" + std::to_string(old), time_grouped(old),
         flops, double(bytes), bench::kFp8Tflops, "fp8_gemm_grouped", t_grouped);
}

// One weight at every K split in --splits (those the device places and K allows), forced, next
// to the planned split's time: the data the cost model is fitted to.
void bench_split_sweep(const char* model, const Shape& s, int m, const Options& o) {
  const int n = s.n, k = s.k;
  if (m > cuda::gemm_cfg::kStreamMaxM) return;
  const int copies = bench::rotation_copies(size_t(n) * k);
  const BenchWeights w(n, k, copies, 23);
  const BenchAct a(m, k);
  const std::vector<const BenchWeights*> ws = {&w};
  std::vector<DeviceBuffer<uint16_t>> ys;
  ys.emplace_back(size_t(m) * n);
  DeviceBuffer<uint8_t> gw(16);
  const int planned = new_split(tiles_of(n), k);
  const int top = std::min(cuda::detail::stream_max_splits_fp8(1), k / 128);
  std::vector<int> splits = o.splits;
  splits.push_back(planned);
  std::sort(splits.begin(), splits.end());
  splits.erase(std::unique(splits.begin(), splits.end()), splits.end());
  const std::string shape = std::string(model) + " " + s.name + " m=" + std::to_string(m) +
                            " n=" + std::to_string(n) + " k=" + std::to_string(k);
  const double flops = 2.0 * m * n * double(k);
  for (int sp : splits) {
    if (sp < 1 || sp > top) continue;
    const double t = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
                       grouped_call(a, ws, ys, c, sp, gw.data(), gw.size(), st);
                     }).median_us(o.iters);
    const int ctas = tiles_of(n) * sp * ((m + 63) / 64);
    emit("stream_split",
         shape + " splits=" + std::to_string(sp) + " ctas=" + std::to_string(ctas) +
             (sp == planned ? " planned" : ""),
         t, flops, double(n) * k, bench::kFp8Tflops, "", 0);
  }
}

void bench_head(const char* model, int vocab, int dim, int m, const Options& o, cublasHandle_t cb) {
  const size_t welems = size_t(vocab) * dim;
  DeviceBuffer<uint16_t> w(welems), x(size_t(m) * dim);
  DeviceBuffer<float> logits(size_t(m) * vocab);
  fill_bf16(w.data(), welems, 5);
  fill_bf16(x.data(), x.size(), 6);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  LogitsParams p;
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data());
  p.m = m;
  p.w = reinterpret_cast<const __nv_bfloat16*>(w.data());
  p.vocab = vocab;
  p.dim = dim;
  p.logits = logits.data();
  p.cublas = cb;
  const double t =
      bench::GraphSet(1, [&](int, cudaStream_t st) { head_logits(p, st); }).median_us(o.iters);
  const float one = 1.0f, zero = 0.0f;
  const double tp = bench::GraphSet(1, [&](int, cudaStream_t st) {
                      CUBLAS_CHECK(cublasSetStream(cb, st));
                      CUBLAS_CHECK(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, vocab, m, dim, &one,
                                                w.data(), CUDA_R_16BF, dim, x.data(), CUDA_R_16BF,
                                                dim, &zero, logits.data(), CUDA_R_32F, vocab,
                                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                    }).median_us(o.iters);
  const std::string shape = std::string(model) + " head m=" + std::to_string(m) +
                            " n=" + std::to_string(vocab) + " k=" + std::to_string(dim);
  const double flops = 2.0 * m * double(vocab) * dim, bytes = double(welems) * 2;
  emit(m <= 64 ? "head_logits(stream)" : "head_logits(cublas)", shape, t, flops, bytes,
       bench::kBf16Tflops, "cublas_bf16_f32out", tp);
}

// A model's FP8 weights and the engine's pairs of them that read one input (attention: wq_a +
// wkv on x, wq_b + indexer wq_b on the q latent), and its BF16 head [vocab, dim].
struct Model {
  const char* name;
  int vocab, dim;
  std::vector<Shape> shapes;
  std::vector<std::pair<int, int>> pairs;  // indices into shapes
};

// A real model (real_config.h) with each weight [n, k] as the engine binds it
// (model/weights.cpp; the fused shared w1 + w3 as backends/cuda/weights.cpp stacks them).
Model real_model(const char* name) {
  const ModelConfig c = bench::real_config(name, false);
  const int dim = c.dim, inter = c.moe_inter_dim;
  return {name,
          c.vocab_size,
          dim,
          {{"wq_a", c.q_lora_rank, dim},
           {"wq_b", c.n_heads * c.head_dim, c.q_lora_rank},
           {"wkv", c.head_dim, dim},
           {"wo_b", dim, c.o_groups * c.o_lora_rank},
           {"indexer_wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank},
           {"shared_w1|w3", inter, dim},
           {"shared_w13_fused", 2 * inter, dim},
           {"shared_w2", dim, inter},
           {"mtp_e|h_proj", dim, dim}},
          {{0, 2}, {1, 4}}};
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  cublasHandle_t cb;
  CUBLAS_CHECK(cublasCreate(&cb));
  LtFp8 lt;
  const Model flash = real_model("flash"), pro = real_model("pro");
  std::vector<const Model*> models;
  if (o.flash) models.push_back(&flash);
  if (o.pro) models.push_back(&pro);
  if (o.sweep) {
    for (const Model* md : models)
      for (const Shape& s : md->shapes)
        for (int m : o.ms) bench_split_sweep(md->name, s, m, o);
    cublasDestroy(cb);
    return 0;
  }
  for (const Model* md : models)
    for (int m : o.ms)
      for (const auto& [a, b] : md->pairs)
        bench_grouped(md->name, md->shapes[a], md->shapes[b], m, o);
  if (o.grouped_only) {
    cublasDestroy(cb);
    return 0;
  }
  for (const Model* md : models)
    for (const Shape& s : md->shapes)
      for (int m : o.ms) bench_linear(md->name, s, m, o, cb, lt);
  // The prefill target: M = 4096, N = 7168, K = 4096..16384.
  for (int k : {4096, 8192, 16384}) bench_linear("target", {"prefill", 7168, k}, 4096, o, cb, lt);
  if (o.head)
    for (const Model* md : models)
      for (int m : o.ms) bench_head(md->name, md->vocab, md->dim, m, o, cb);
  cublasDestroy(cb);
  return 0;
}
