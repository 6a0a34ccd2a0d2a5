// The decode-sized BF16 linear (ops/cuda/gemm/bf16_stream_linear.h) against the exact sums (in
// double: BF16 products are exact, and K <= 7168 of them lose nothing measurable there) and
// against cpu::linear (kF32 for the fp32 outputs, as the CPU runs the compressors' projections;
// kBf16 for the BF16 ones, as it runs weights_proj). The bound is derived from the kernel's
// arithmetic: every output is an fp32 chain of at most ceil(k / 256) * 8 FMAs then 5 butterfly
// additions, each rounding within 2^-24 of its partial, so |y - exact| <= (that many) * 2^-24 *
// sum |w x| (the usual recursive-summation bound), plus half an ulp of the output format where y
// is rounded to BF16; against the CPU its own rounding (half an fp32 / BF16 ulp) is added. Real
// shapes (the stacked compressor projections with weights_proj in one launch, Flash 4096 and Pro
// 7168 wide, HCA's single weight), every m from 1 to 8, K not a multiple of the 256-element lane
// stride, n of 1 and 17, row strides; outputs poisoned (columns past n and rows past m must stay
// so); two runs bit-identical; a captured graph with PDL launches equal to the eager run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "core/rng.h"
#include "cuda/gpu_test.h"
#include "ops/cpu/error_bound.h"
#include "ops/cpu/linear.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/gemm/bf16_stream_linear.h"
#include "support/bf16_vectors.h"

namespace dsv4 {
namespace {

using cuda::DeviceBuffer;
using test::to_bf16_bits;
using bf16 = __nv_bfloat16;

class Bf16StreamLinear : public test::GpuTest {};

struct Weight {
  int n;
  bool f32;
  std::vector<float> w;  // [n, k], BF16 values
};

// BF16 values of a mixed magnitude; a few rows/columns that cancel (x and -x pairs).
std::vector<float> random_bf16_values(Rng& rng, size_t count, float scale) {
  std::vector<float> v(count);
  for (auto& x : v) x = round_bf16(float(rng.normal()) * scale);
  return v;
}

// Checks one launch of `weights` on m rows of x [m, k] (row stride ldx), outputs at ldy = n + pad.
void check(int m, int k, std::vector<Weight> weights, int64_t ldx, int pad, uint64_t seed) {
  const std::string what = cat("m=", m, " k=", k, " ldx=", ldx, " pad=", pad,
                               " weights=", weights.size(), " n0=", weights[0].n);
  SCOPED_TRACE(what);
  Rng rng(seed);
  std::vector<float> x(size_t(m) * ldx, 0.0f);
  for (int i = 0; i < m; ++i)
    for (int c = 0; c < k; ++c) x[size_t(i) * ldx + c] = round_bf16(float(rng.normal()));
  if (m > 1)  // row 1 = -row 0 on the first half: cancellation against the weights' rows
    for (int c = 0; c < k / 2; ++c) x[size_t(1) * ldx + c] = -x[c];
  for (auto& wt : weights) wt.w = random_bf16_values(rng, size_t(wt.n) * k, 0.05f);

  DeviceBuffer<uint16_t> dx(to_bf16_bits(x));
  std::vector<DeviceBuffer<uint16_t>> dw;
  std::vector<DeviceBuffer<uint8_t>> dy[2];  // two runs
  cuda::Bf16StreamLinearParams p;
  p.x = reinterpret_cast<const bf16*>(dx.data());
  p.ldx = ldx;
  p.m = m;
  p.k = k;
  p.count = int(weights.size());
  for (const auto& wt : weights) dw.emplace_back(to_bf16_bits(wt.w));
  for (int run = 0; run < 2; ++run) {
    for (size_t j = 0; j < weights.size(); ++j) {
      const int64_t ldy = weights[j].n + pad;
      // Poisoned: kBf16StreamMaxM rows, so rows past m are checked untouched too.
      dy[run].emplace_back(size_t(cuda::kBf16StreamMaxM) * ldy * (weights[j].f32 ? 4 : 2));
      dy[run].back().fill_bytes(0xff);
      p.out[j] = {reinterpret_cast<const bf16*>(dw[j].data()), weights[j].n, dy[run].back().data(),
                  ldy, weights[j].f32};
    }
    p.pdl = run == 1;
    cuda::bf16_stream_linear(p, nullptr);
  }
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());

  std::vector<float> dense(size_t(m) * k);
  for (int i = 0; i < m; ++i)
    for (int c = 0; c < k; ++c) dense[size_t(i) * k + c] = x[size_t(i) * ldx + c];
  const int roundings = (k + 255) / 256 * 8 + 5;
  for (size_t j = 0; j < weights.size(); ++j) {
    const Weight& wt = weights[j];
    const int64_t ldy = wt.n + pad;
    const std::vector<uint8_t> got = dy[0][j].download();
    EXPECT_TRUE(got == dy[1][j].download()) << "weight " << j << ": runs differ";
    const cpu::Linear lin = cpu::Linear::from_rows(
        wt.f32 ? cpu::LinearKind::kF32 : cpu::LinearKind::kBf16, wt.n, k, wt.w);
    std::vector<float> cpu_y(size_t(m) * wt.n);
    cpu::linear(lin, dense.data(), m, cpu_y.data());
    int64_t bad = 0, bad_cpu = 0, poison = 0;
    for (int i = 0; i < cuda::kBf16StreamMaxM; ++i)
      for (int64_t c = 0; c < ldy; ++c) {
        const size_t e = size_t(i) * ldy + c;
        uint32_t bits = 0;
        if (wt.f32)
          std::memcpy(&bits, &got[e * 4], 4);
        else
          bits = uint32_t(got[e * 2]) | uint32_t(got[e * 2 + 1]) << 8;
        const bool untouched = wt.f32 ? bits == 0xffffffffu : bits == 0xffffu;
        if (i >= m || c >= wt.n) {
          poison += !untouched;
          continue;
        }
        double exact = 0.0, mag = 0.0;
        for (int q = 0; q < k; ++q) {
          const double pr = double(dense[size_t(i) * k + q]) * wt.w[size_t(c) * k + q];
          exact += pr;
          mag += std::fabs(pr);
        }
        float y;
        if (wt.f32)
          std::memcpy(&y, &bits, 4);
        else
          y = bf16_to_float(uint16_t(bits));
        // The fp32 sum before rounding is within `sum_bound` of exact; a BF16 output adds half
        // an ulp of the binade of that sum (bounded via the rounded value's own binade, one up).
        const double sum_bound = 1.01 * roundings * std::ldexp(mag, -24);
        const double out_round = wt.f32 ? 0.0 : 0.5 * cpu::bf16_ulp(std::fabs(exact) + sum_bound);
        const double err = std::fabs(double(y) - exact);
        if (!(err <= sum_bound + out_round)) {
          if (++bad <= 5)
            ADD_FAILURE() << "weight " << j << " [" << i << ", " << c << "]: " << y << " vs exact "
                          << exact << " (bound " << sum_bound + out_round << ")";
        }
        const double cpu_round =
            wt.f32 ? 0.5 * cpu::f32_ulp(exact)
                   : 0.5 * cpu::f32_ulp(exact) + 0.5 * cpu::bf16_ulp(std::fabs(exact) + sum_bound);
        if (!(std::fabs(double(y) - cpu_y[size_t(i) * wt.n + c]) <=
              sum_bound + out_round + cpu_round))
          ++bad_cpu;
      }
    EXPECT_EQ(bad, 0) << "weight " << j << ": outside the derived bound of the exact sums";
    EXPECT_EQ(bad_cpu, 0) << "weight " << j << ": outside the bound of cpu::linear";
    EXPECT_EQ(poison, 0) << "weight " << j << ": columns past n or rows past m written";
  }
}

TEST_F(Bf16StreamLinear, RealShapes) {
  uint64_t seed = 1;
  // Flash CSA: [main wkv; wgate; indexer wkv; wgate] 2560 rows fp32 + weights_proj 64 BF16.
  for (int m : {1, 2, 3, 4, 5, 8})
    check(m, 4096, {{2560, true, {}}, {64, false, {}}}, 4096, 0, seed++);
  // Flash HCA: [wkv; wgate] 1024 rows, one weight. Pro CSA (7168 wide).
  check(1, 4096, {{1024, true, {}}}, 4096, 0, seed++);
  check(6, 4096, {{1024, true, {}}}, 4096, 0, seed++);
  check(1, 7168, {{2560, true, {}}, {64, false, {}}}, 7168, 0, seed++);
  check(7, 7168, {{2560, true, {}}, {64, false, {}}}, 7168, 0, seed++);
}

TEST_F(Bf16StreamLinear, EdgeSizes) {
  uint64_t seed = 100;
  check(1, 8, {{1, true, {}}}, 8, 0, seed++);                          // one chunk, one output
  check(2, 136, {{17, false, {}}, {3, true, {}}}, 144, 5, seed++);     // partial lane stride
  check(3, 264, {{33, true, {}}, {1, false, {}}}, 264, 1, seed++);     // one chunk past 256
  check(8, 2048 + 8, {{15, false, {}}}, 2048 + 64, 3, seed++);         // odd rows per CTA
  check(4, 512, {{200, true, {}}, {129, false, {}}}, 512, 0, seed++);  // rows across CTAs
}

TEST_F(Bf16StreamLinear, GraphWithPdlEqualsEager) {
  Rng rng(7);
  const int m = 2, k = 4096, n = 1024;
  const std::vector<float> x = random_bf16_values(rng, size_t(m) * k, 1.0f),
                           w = random_bf16_values(rng, size_t(n) * k, 0.05f);
  DeviceBuffer<uint16_t> dx(to_bf16_bits(x)), dw(to_bf16_bits(w));
  DeviceBuffer<float> eager(size_t(m) * n), graph(size_t(m) * n);
  eager.fill_bytes(0xff);
  graph.fill_bytes(0xff);
  cuda::Bf16StreamLinearParams p;
  p.x = reinterpret_cast<const bf16*>(dx.data());
  p.m = m;
  p.k = k;
  p.out[0] = {reinterpret_cast<const bf16*>(dw.data()), n, eager.data(), n, true};
  cuda::bf16_stream_linear(p, nullptr);
  cudaStream_t s;
  DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  p.out[0].y = graph.data();
  p.pdl = true;
  cudaGraph_t g;
  cudaGraphExec_t e;
  DSV4_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  cuda::bf16_stream_linear(p, s);  // twice: the second launch follows the first with PDL
  cuda::bf16_stream_linear(p, s);
  DSV4_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  DSV4_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  DSV4_CUDA_CHECK(cudaGraphLaunch(e, s));
  DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> a = eager.download(), b = graph.download();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  DSV4_CUDA_CHECK(cudaGraphExecDestroy(e));
  DSV4_CUDA_CHECK(cudaGraphDestroy(g));
  DSV4_CUDA_CHECK(cudaStreamDestroy(s));
}

// Argument checks precede any CUDA call (fake, aligned pointers).
TEST(Bf16StreamLinearApi, RejectsBadParams) {
  auto* x = reinterpret_cast<const bf16*>(uintptr_t(1) << 20);
  auto* y = reinterpret_cast<void*>(uintptr_t(2) << 20);
  cuda::Bf16StreamLinearParams p;
  p.x = x;
  p.m = 1;
  p.k = 64;
  p.out[0] = {x, 4, y, 4, true};
  p.m = cuda::kBf16StreamMaxM + 1;
  EXPECT_THROW(cuda::bf16_stream_linear(p, nullptr), Error);  // too many rows
  p.m = 1;
  p.k = 60;
  EXPECT_THROW(cuda::bf16_stream_linear(p, nullptr), Error);  // k not a multiple of 8
  p.k = 64;
  p.ldx = 68;
  EXPECT_THROW(cuda::bf16_stream_linear(p, nullptr), Error);  // ldx not a multiple of 8
  p.ldx = 0;
  p.out[0].ldy = 3;
  EXPECT_THROW(cuda::bf16_stream_linear(p, nullptr), Error);  // ldy < n
  p.out[0].ldy = 4;
  p.out[0].w = x + 4;
  EXPECT_THROW(cuda::bf16_stream_linear(p, nullptr), Error);  // misaligned weight
  p.out[0].w = x;
  p.count = 3;
  EXPECT_THROW(cuda::bf16_stream_linear(p, nullptr), Error);  // too many weights
  p.count = 2;
  EXPECT_THROW(cuda::bf16_stream_linear(p, nullptr), Error);  // second weight missing
  p.count = 1;
  p.x = x + 4;
  EXPECT_THROW(cuda::bf16_stream_linear(p, nullptr), Error);  // misaligned x
  p.m = 0;
  EXPECT_NO_THROW(cuda::bf16_stream_linear(p, nullptr));  // nothing to do
}

}  // namespace
}  // namespace dsv4
