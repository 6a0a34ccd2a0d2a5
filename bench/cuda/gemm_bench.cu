// FP8 block-scaled GEMM and head logits at DeepSeek-V4 Flash and Pro shapes, side by side in the
// same run with cuBLAS BF16 (cublasGemmEx on the dequantised weight) and cuBLASLt FP8 (per-tensor
// scale) on the same shapes. Weights are rotated through more memory than the L2 holds.
//
// One JSON line per (kernel, shape): µs, TFLOPS, TB/s on the weight bytes, the roofline
// max(weight bytes / 4.3 TB/s, flops / tensor rate) and the fraction of it reached.
//   kernel "fp8_gemm"            : our GEMM on pre-quantised activations (peer: cuBLASLt FP8)
//   kernel "fp8_linear"          : activation quantisation + GEMM (peer: cuBLAS BF16)
//   kernel "act_quant"           : the quantisation kernel alone (bytes: BF16 in + e4m3 out)
//   kernel "cublas_bf16" / "cublaslt_fp8_per_tensor": the peers with their own rooflines
//   kernel "head_logits"         : our head (peer: cuBLAS BF16 -> fp32)
//   kernel "fp8_gemm_grouped"    : the engine's pairs of weights on one input in one launch
//                                  (wq_a + wkv, wq_b + indexer wq_b; peer: the two fp8_gemm
//                                  launches one after the other)
// Usage: gemm_bench [--model flash|pro|all] [--m 1,4,16] [--iters N] [--no-head] [--grouped]
//   --grouped: only the grouped pairs (and their separate launches)
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
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/gemm/fp8_gemm.h"
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
  bool flash = true, pro = true, head = true, grouped_only = false;
  std::vector<int> ms = {1, 4, 16, 64, 256, 4096};
  int iters = 30;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) {
      const std::string m = argv[++i];
      o.flash = m == "flash" || m == "all";
      o.pro = m == "pro" || m == "all";
    } else if (a == "--m" && i + 1 < argc) {
      o.ms.clear();
      for (char* t = std::strtok(argv[++i], ","); t; t = std::strtok(nullptr, ","))
        o.ms.push_back(std::atoi(t));
    } else if (a == "--iters" && i + 1 < argc) {
      o.iters = std::atoi(argv[++i]);
    } else if (a == "--no-head") {
      o.head = false;
    } else if (a == "--grouped") {
      o.grouped_only = true;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--model flash|pro|all] [--m 1,4,16] [--iters N] [--no-head] "
                   "[--grouped]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  return o;
}

// cuBLASLt FP8 e4m3 x e4m3 -> BF16 with per-tensor scales (the anchors' torch._scaled_mm).
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
           cudaStream_t s) {
    cublasLtMatmulDesc_t op;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const float* sp = one.data();
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sp, sizeof sp));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sp, sizeof sp));
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

void bench_linear(const char* model, const Shape& s, int m, const Options& o, cublasHandle_t cb,
                  LtFp8& lt) {
  const int n = s.n, k = s.k;
  const size_t wbytes = size_t(n) * k;
  const int copies = bench::rotation_copies(wbytes);
  std::vector<DeviceBuffer<uint8_t>> wq;
  std::vector<DeviceBuffer<float>> wsc;
  for (int c = 0; c < copies; ++c) {
    wq.emplace_back(wbytes);
    fill_bytes(wq.back().data(), wbytes, 17 + c);
    wsc.emplace_back(size_t(k / 128) * ((n + 127) / 128));
    bench::fill_f32_const_kernel<<<64, 256>>>(wsc.back().data(), wsc.back().size(), 1.0f / 64);
  }
  DeviceBuffer<uint16_t> x(size_t(m) * k), y(size_t(m) * n);
  fill_bf16(x.data(), x.size(), 3);
  const int ld = fp8_scale_ld(m);
  DeviceBuffer<uint8_t> xq(size_t(m) * k);
  DeviceBuffer<float> xs(size_t(k / 128) * ld);
  const size_t gws = fp8_gemm_workspace_bytes(m, n, k);
  const size_t lws = fp8_linear_workspace_bytes(m, n, k);
  DeviceBuffer<uint8_t> gw(std::max<size_t>(gws, 16)), lw(std::max<size_t>(lws, 16));
  auto bx = reinterpret_cast<const __nv_bfloat16*>(x.data());
  auto by = reinterpret_cast<__nv_bfloat16*>(y.data());
  ActQuantParams q;
  q.x = bx;
  q.m = m;
  q.k = k;
  q.codes = xq.data();
  q.scales_t = xs.data();
  q.ld_scales = ld;
  quantize_act_fp8(q, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());

  const double flops = 2.0 * m * n * double(k);
  const std::string shape = std::string(model) + " " + s.name + " m=" + std::to_string(m) +
                            " n=" + std::to_string(n) + " k=" + std::to_string(k);

  const double t_quant =
      bench::GraphSet(1, [&](int, cudaStream_t st) { quantize_act_fp8(q, st); }).median_us(o.iters);
  const double t_gemm = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
                          Fp8GemmParams g;
                          g.a_codes = xq.data();
                          g.a_scales_t = xs.data();
                          g.a_ld_scales = ld;
                          g.m = m;
                          g.w = {wq[c].data(), wsc[c].data(), n, k};
                          g.y = by;
                          g.workspace = gw.data();
                          g.workspace_bytes = gw.size();
                          fp8_gemm(g, st);
                        }).median_us(o.iters);
  const double t_linear = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
                            Fp8LinearParams p;
                            p.x = bx;
                            p.m = m;
                            p.w = {wq[c].data(), wsc[c].data(), n, k};
                            p.y = by;
                            p.workspace = lw.data();
                            p.workspace_bytes = lw.size();
                            fp8_linear(p, st);
                          }).median_us(o.iters);

  // cuBLASLt FP8 per-tensor on the same codes.
  double t_lt = -1;
  if (lt.run(wq[0].data(), xq.data(), by, m, n, k, nullptr)) {
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    t_lt = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
             lt.run(wq[c].data(), xq.data(), by, m, n, k, st);
           }).median_us(o.iters);
  }
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
                                  CUDA_R_16BF, k, x.data(), CUDA_R_16BF, k, &zero, y.data(),
                                  CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }).median_us(o.iters);

  const double fp8 = bench::kFp8Tflops, bf = bench::kBf16Tflops;
  emit("fp8_gemm", shape, t_gemm, flops, double(wbytes), fp8, "cublaslt_fp8_per_tensor", t_lt);
  emit("fp8_linear", shape, t_linear, flops, double(wbytes), fp8, "cublas_bf16", t_bf16);
  emit("act_quant", shape, t_quant, 0, double(m) * k * 3 + double(m) * (k / 128) * 4, fp8, "", 0);
  if (t_lt > 0) emit("cublaslt_fp8_per_tensor", shape, t_lt, flops, double(wbytes), fp8, "", 0);
  emit("cublas_bf16", shape, t_bf16, flops, double(wb16), bf, "", 0);
}

// Two weights on one quantised input: one grouped launch against the two launches of fp8_gemm.
void bench_grouped(const char* model, const Shape& a, const Shape& b, int m, const Options& o) {
  const int k = a.k;
  const Shape s2[2] = {a, b};
  size_t bytes = 0;
  for (const Shape& s : s2) bytes += size_t(s.n) * k;
  const int copies = bench::rotation_copies(bytes);
  std::vector<DeviceBuffer<uint8_t>> wq[2];
  std::vector<DeviceBuffer<float>> wsc[2];
  std::vector<DeviceBuffer<uint16_t>> ys;
  size_t gws = 16;
  for (int i = 0; i < 2; ++i) {
    for (int c = 0; c < copies; ++c) {
      wq[i].emplace_back(size_t(s2[i].n) * k);
      fill_bytes(wq[i].back().data(), wq[i].back().size(), 41 + 2 * c + i);
      wsc[i].emplace_back(size_t(k / 128) * ((s2[i].n + 127) / 128));
      bench::fill_f32_const_kernel<<<64, 256>>>(wsc[i].back().data(), wsc[i].back().size(),
                                                1.0f / 64);
    }
    ys.emplace_back(size_t(m) * s2[i].n);
    gws = std::max(gws, fp8_gemm_workspace_bytes(m, s2[i].n, k));
  }
  DeviceBuffer<uint16_t> x(size_t(m) * k);
  fill_bf16(x.data(), x.size(), 3);
  const int ld = fp8_scale_ld(m);
  DeviceBuffer<uint8_t> xq(size_t(m) * k), gw(gws);
  DeviceBuffer<float> xs(size_t(k / 128) * ld);
  ActQuantParams q;
  q.x = reinterpret_cast<const __nv_bfloat16*>(x.data());
  q.m = m;
  q.k = k;
  q.codes = xq.data();
  q.scales_t = xs.data();
  q.ld_scales = ld;
  quantize_act_fp8(q, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const double t_grouped = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
                             Fp8GemmGroupedParams g;
                             g.a_codes = xq.data();
                             g.a_scales_t = xs.data();
                             g.a_ld_scales = ld;
                             g.m = m;
                             g.count = 2;
                             for (int i = 0; i < 2; ++i) {
                               g.w[i] = {wq[i][c].data(), wsc[i][c].data(), s2[i].n, k};
                               g.y[i] = reinterpret_cast<__nv_bfloat16*>(ys[i].data());
                             }
                             g.workspace = gw.data();
                             g.workspace_bytes = gw.size();
                             fp8_gemm_grouped(g, st);
                           }).median_us(o.iters);
  const double t_separate = bench::GraphSet(copies, [&](int c, cudaStream_t st) {
                              for (int i = 0; i < 2; ++i) {
                                Fp8GemmParams g;
                                g.a_codes = xq.data();
                                g.a_scales_t = xs.data();
                                g.a_ld_scales = ld;
                                g.m = m;
                                g.w = {wq[i][c].data(), wsc[i][c].data(), s2[i].n, k};
                                g.y = reinterpret_cast<__nv_bfloat16*>(ys[i].data());
                                g.workspace = gw.data();
                                g.workspace_bytes = gw.size();
                                fp8_gemm(g, st);
                              }
                            }).median_us(o.iters);
  double flops = 0;
  for (const Shape& s : s2) flops += 2.0 * m * s.n * double(k);
  const std::string shape = std::string(model) + " " + a.name + "+" + b.name +
                            " m=" + std::to_string(m) + " n=" + std::to_string(a.n) + "+" +
                            std::to_string(b.n) + " k=" + std::to_string(k);
  emit("fp8_gemm_grouped", shape, t_grouped, flops, double(bytes), bench::kFp8Tflops,
       "fp8_gemm_x2_separate", t_separate);
}

void bench_head(const char* model, int dim, int m, const Options& o, cublasHandle_t cb) {
  const int vocab = 129280;
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
  const std::string shape =
      std::string(model) + " head m=" + std::to_string(m) + " n=129280 k=" + std::to_string(dim);
  const double flops = 2.0 * m * double(vocab) * dim, bytes = double(welems) * 2;
  emit(m <= 64 ? "head_logits(stream)" : "head_logits(cublas)", shape, t, flops, bytes,
       bench::kBf16Tflops, "cublas_bf16_f32out", tp);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  cublasHandle_t cb;
  CUBLAS_CHECK(cublasCreate(&cb));
  LtFp8 lt;
  const std::vector<Shape> flash = {{"wq_a", 1024, 4096},
                                    {"wq_b", 32768, 1024},
                                    {"wkv", 512, 4096},
                                    {"wo_b", 4096, 8192},
                                    {"indexer_wq_b", 8192, 1024},
                                    {"shared_w1|w3", 2048, 4096},
                                    {"shared_w13_fused", 4096, 4096},
                                    {"shared_w2", 4096, 2048},
                                    {"mtp_e|h_proj", 4096, 4096}};
  const std::vector<Shape> pro = {{"wq_a", 1536, 7168},
                                  {"wq_b", 65536, 1536},
                                  {"wkv", 512, 7168},
                                  {"wo_b", 7168, 16384},
                                  {"indexer_wq_b", 8192, 1536},
                                  {"shared_w1|w3", 3072, 7168},
                                  {"shared_w13_fused", 6144, 7168},
                                  {"shared_w2", 7168, 3072},
                                  {"mtp_e|h_proj", 7168, 7168}};
  // The engine's grouped pairs (attention: wq_a + wkv on x, wq_b + indexer wq_b on the q latent).
  if (o.flash)
    for (int m : o.ms) {
      bench_grouped("flash", flash[0], flash[2], m, o);
      bench_grouped("flash", flash[1], flash[4], m, o);
    }
  if (o.pro)
    for (int m : o.ms) {
      bench_grouped("pro", pro[0], pro[2], m, o);
      bench_grouped("pro", pro[1], pro[4], m, o);
    }
  if (o.grouped_only) {
    cublasDestroy(cb);
    return 0;
  }
  if (o.flash)
    for (const auto& s : flash)
      for (int m : o.ms) bench_linear("flash", s, m, o, cb, lt);
  if (o.pro)
    for (const auto& s : pro)
      for (int m : o.ms) bench_linear("pro", s, m, o, cb, lt);
  // The prefill target: M = 4096, N = 7168, K = 4096..16384.
  for (int k : {4096, 8192, 16384}) bench_linear("target", {"prefill", 7168, k}, 4096, o, cb, lt);
  if (o.head) {
    if (o.flash)
      for (int m : o.ms) bench_head("flash", 4096, m, o, cb);
    if (o.pro)
      for (int m : o.ms) bench_head("pro", 7168, m, o, cb);
  }
  cublasDestroy(cb);
  return 0;
}
