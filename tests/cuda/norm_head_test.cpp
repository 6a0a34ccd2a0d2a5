// RMSNorm, the embedding gather and the head's logits on the GPU (ops/cuda/norm/norm.h,
// ops/cuda/head/head.h) against the CPU: rms_norm bit-identical to cpu::rms_norm (same fp64 sum,
// same rounded fp32 operations), the embedding an exact copy (+ repeat into hc streams, bad ids
// counted and zeroed), logits against cpu::linear(kF32) within the tolerance (relative L2
// <= 4e-3, >= 99% within 1 BF16 ulp; the printed relative L2 is expected near 1e-6, since BF16
// products are exact and only the fp32 summation differs).
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/formats.h"
#include "core/rng.h"
#include "cuda/cuda_support.h"
#include "cuda/gpu_test.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/norm.h"
#include "ops/cuda/common/device.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/head/head.h"
#include "ops/cuda/norm/norm.h"
#include "support/bf16_vectors.h"
#include "support/random_values.h"

namespace dsv4 {
namespace {

using cuda::DeviceBuffer;
using test::bf16_ptr;
using test::bf16_ulp;
using test::random_bf16;
using test::to_bf16_bits;

class CudaNormHead : public test::GpuTest {};

// ---- RMSNorm ---------------------------------------------------------------------------------

void check_norm(int rows, int n, bool in_place, int64_t ld, uint64_t seed) {
  Rng rng(seed);
  const int64_t stride = ld ? ld : n;
  std::vector<float> x(size_t(rows) * stride, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const float mag = std::ldexp(1.0f, int(rng.below(20)) - 10);
    for (int i = 0; i < n; ++i) x[size_t(r) * stride + i] = round_bf16(float(rng.normal()) * mag);
  }
  if (rows > 2)
    for (int i = 0; i < n; ++i) x[size_t(2) * stride + i] = 0.0f;  // an all-zero row: y = 0
  std::vector<float> w(n);
  for (auto& v : w) v = round_bf16(float(rng.uniform(-2.0, 2.0)));
  std::vector<float> dense(size_t(rows) * n), ref(size_t(rows) * n);
  for (int r = 0; r < rows; ++r)
    std::copy_n(x.begin() + size_t(r) * stride, n, dense.begin() + size_t(r) * n);
  cpu::rms_norm(dense.data(), rows, n, w.data(), 1e-6f, ref.data());

  DeviceBuffer<uint16_t> dx(to_bf16_bits(x)), dw(to_bf16_bits(w)), dy(size_t(rows) * stride);
  dy.fill_bytes(0xff);
  cuda::RmsNormParams p;
  p.x = bf16_ptr(dx);
  p.ldx = ld;
  p.rows = rows;
  p.n = n;
  p.weight = bf16_ptr(dw);
  p.eps = 1e-6f;
  p.y = in_place ? bf16_ptr(dx) : bf16_ptr(dy);
  p.ldy = ld;
  cuda::rms_norm(p, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = in_place ? dx.download() : dy.download();
  int64_t bad = 0, first = -1;
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < stride; ++i) {
      const uint16_t g = got[size_t(r) * stride + i];
      if (i >= n) {
        if (!in_place) {
          EXPECT_EQ(g, 0xffff) << "row padding [" << r << ", " << i << "] written";
        }
        continue;
      }
      if (g != float_to_bf16(ref[size_t(r) * n + i])) {
        if (first < 0) first = int64_t(r) * n + i;
        ++bad;
      }
    }
  EXPECT_EQ(bad, 0) << "rms_norm rows=" << rows << " n=" << n << (in_place ? " in place" : "")
                    << ": " << bad << " differ; first [" << first / n << ", " << first % n
                    << "] want " << (first >= 0 ? ref[first] : 0.f);
}

TEST_F(CudaNormHead, Smoke) {
  check_norm(4, 512, false, 0, 1);
}

TEST_F(CudaNormHead, RmsNormBitExact) {
  uint64_t seed = 10;
  for (int n : {8, 128, 136, 512, 1024, 1536, 2056, 4096, 7168, 16384})
    for (int rows : {1, 3, 17, 65}) check_norm(rows, n, false, 0, seed++);
  check_norm(1000, 4096, false, 0, seed++);
  check_norm(33, 1536, true, 0, seed++);
  check_norm(9, 512, false, 520, seed++);  // row strides
}

// ---- embedding ---------------------------------------------------------------------------------

TEST_F(CudaNormHead, EmbedGatherAndRepeat) {
  Rng rng(20);
  const int vocab = 1000, dim = 264;
  const std::vector<float> table = random_bf16(rng, size_t(vocab) * dim, 1.0f);
  DeviceBuffer<uint16_t> dt(to_bf16_bits(table));
  for (int repeat : {1, 4}) {
    std::vector<int32_t> ids = {0, 999, 17, 17, 500, -1, 1000, 3};
    DeviceBuffer<int32_t> di(ids);
    DeviceBuffer<uint16_t> dout(ids.size() * repeat * dim);
    DeviceBuffer<int> bad(1);
    dout.fill_bytes(0xff);
    bad.fill_bytes(0);
    cuda::EmbedParams p;
    p.tokens = di.data();
    p.n = int(ids.size());
    p.table = bf16_ptr(dt);
    p.vocab = vocab;
    p.dim = dim;
    p.repeat = repeat;
    p.out = bf16_ptr(dout);
    p.bad_tokens = bad.data();
    cuda::embed(p, nullptr);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const auto out = dout.download();
    EXPECT_EQ(bad.download()[0], 2) << "two ids are out of range";
    for (size_t t = 0; t < ids.size(); ++t)
      for (int k = 0; k < repeat; ++k)
        for (int d = 0; d < dim; ++d) {
          const bool ok_id = ids[t] >= 0 && ids[t] < vocab;
          const uint16_t want = ok_id ? float_to_bf16(table[size_t(ids[t]) * dim + d]) : 0;
          ASSERT_EQ(out[(t * repeat + k) * dim + d], want)
              << "token " << t << " (id " << ids[t] << ") copy " << k << " dim " << d;
        }
  }
}

// ---- head logits -------------------------------------------------------------------------------

struct HeadCase {
  int m, vocab, dim;
};

void check_logits(const HeadCase& c, cublasHandle_t handle, uint64_t seed) {
  Rng rng(seed);
  // Uniform weights (cheap to draw for the 530M values of the real head).
  std::vector<float> w(size_t(c.vocab) * c.dim);
  for (auto& v : w) v = round_bf16(float(rng.uniform(-0.05, 0.05)));
  const std::vector<float> x = random_bf16(rng, size_t(c.m) * c.dim, 1.0f);
  std::vector<float> ref(size_t(c.m) * c.vocab);
  if (size_t(c.vocab) * c.dim <= (size_t(64) << 20)) {
    const cpu::Linear lin = cpu::Linear::from_rows(cpu::LinearKind::kF32, c.vocab, c.dim, w);
    cpu::linear(lin, x.data(), c.m, ref.data());
  } else {
    // The full vocabulary: the same math as kF32 (one K block summed in fp64, rounded to fp32)
    // without cpu::Linear's transposed copy of a 2 GB matrix.
    for (int r = 0; r < c.m; ++r)
      for (int o = 0; o < c.vocab; ++o) {
        double s = 0;
        const float* wr = w.data() + size_t(o) * c.dim;
        const float* xr = x.data() + size_t(r) * c.dim;
        for (int i = 0; i < c.dim; ++i) s += double(xr[i]) * double(wr[i]);
        ref[size_t(r) * c.vocab + o] = float(s);
      }
  }
  DeviceBuffer<uint16_t> dw(to_bf16_bits(w)), dx(to_bf16_bits(x));
  DeviceBuffer<float> dl(size_t(c.m) * c.vocab);
  dl.fill_bytes(0xff);
  cuda::LogitsParams p;
  p.x = bf16_ptr(dx);
  p.m = c.m;
  p.w = bf16_ptr(dw);
  p.vocab = c.vocab;
  p.dim = c.dim;
  p.logits = dl.data();
  p.cublas = handle;
  cuda::head_logits(p, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = dl.download();
  double num = 0, den = 0;
  int64_t ok = 0, nan = 0, first = -1;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i])) {
      ++nan;
      if (first < 0) first = int64_t(i);
      continue;
    }
    const double d = double(got[i]) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
    if (std::fabs(d) <= bf16_ulp(std::max(std::fabs(got[i]), std::fabs(ref[i]))))
      ++ok;
    else if (first < 0)
      first = int64_t(i);
  }
  const double rel = std::sqrt(num / std::max(den, 1e-300));
  const double frac = double(ok) / double(ref.size());
  const std::string what = cat("logits m=", c.m, " vocab=", c.vocab, " dim=", c.dim);
  std::string where;
  if (first >= 0)
    where = cat(" first bad [", first / c.vocab, ", ", first % c.vocab, "]: got ", got[first],
                " want ", ref[first]);
  EXPECT_EQ(nan, 0) << what << ": NaN (poison left?)" << where;
  EXPECT_LE(rel, 4e-3) << what << where;
  EXPECT_GE(frac, 0.99) << what << where;
  std::printf("[ metric ] %s rel_l2=%.3g within_1ulp=%.5f\n", what.c_str(), rel, frac);
}

TEST_F(CudaNormHead, LogitsStreamingKernel) {
  uint64_t seed = 30;
  for (int m : {1, 3, 17, 63, 64}) check_logits({m, 4099, 4096}, nullptr, seed++);
  check_logits({5, 1000, 7168}, nullptr, seed++);
  check_logits({2, 129280, 4096}, nullptr, seed++);  // the real head (1 GB of weights)
}

TEST_F(CudaNormHead, LogitsCublas) {
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  uint64_t seed = 40;
  for (int m : {65, 100, 300}) check_logits({m, 4099, 4096}, h, seed++);
  cublasDestroy(h);
  // Without a handle, m > 64 is refused.
  cuda::LogitsParams p;
  p.m = 65;
  p.vocab = 8;
  p.dim = 64;
  DeviceBuffer<uint16_t> dx(65 * 64), dw(8 * 64);
  DeviceBuffer<float> dl(65 * 8);
  p.x = bf16_ptr(dx);
  p.w = bf16_ptr(dw);
  p.logits = dl.data();
  EXPECT_THROW(cuda::head_logits(p, nullptr), Error);
}

TEST(NormHeadApi, RejectsBadShapes) {
  cuda::RmsNormParams r;
  r.rows = 1;
  r.n = 100;  // not a multiple of 8
  EXPECT_THROW(cuda::rms_norm(r, nullptr), Error);
  r.n = 32768;  // too wide
  EXPECT_THROW(cuda::rms_norm(r, nullptr), Error);
  cuda::LogitsParams l;
  l.m = 1;
  l.vocab = 10;
  l.dim = 100;  // not a multiple of 64
  EXPECT_THROW(cuda::head_logits(l, nullptr), Error);
}

}  // namespace
}  // namespace dsv4
