// The device's FP8/FP4/BF16 conversions agree with the CPU format tables (skipped without a
// GPU, saying so).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/formats.h"
#include "cuda/gpu_test.h"
#include "ops/cuda/common/device.h"
#include "ops/cuda/formats/format_kernels.h"

namespace dsv4 {
namespace {

class CudaFormats : public test::GpuTest {};

TEST_F(CudaFormats, DecodeEveryCode) {
  std::vector<float> e4m3, e2m1;
  cuda::decode_all_codes(e4m3, e2m1);
  for (int c = 0; c < 256; ++c) {
    const float cpu = e4m3_to_float(uint8_t(c));
    if (std::isnan(cpu))
      EXPECT_TRUE(std::isnan(e4m3[c])) << c;
    else
      EXPECT_EQ(e4m3[c], cpu) << "e4m3 code " << c;
  }
  for (int c = 0; c < 16; ++c) EXPECT_EQ(e2m1[c], e2m1_to_float(uint8_t(c))) << "e2m1 code " << c;
}

TEST_F(CudaFormats, EncodeMatchesCpu) {
  std::mt19937 rng(7);
  std::vector<float> x;
  // Every finite e4m3 value, every midpoint between finite neighbours (ties), and random
  // magnitudes (code 0x7f is NaN, so the last pair is 0x7d/0x7e).
  for (int c = 0; c < 126; ++c) {
    const float v = e4m3_to_float(uint8_t(c)), w = e4m3_to_float(uint8_t(c + 1));
    x.insert(x.end(), {v, -v, 0.5f * (v + w), -0.5f * (v + w)});
  }
  std::uniform_real_distribution<float> u(-500.f, 500.f);
  for (int i = 0; i < 100000; ++i)
    x.push_back(u(rng) * std::pow(2.0f, float(int(rng() % 20) - 10)));
  std::vector<uint8_t> e4m3;
  std::vector<uint16_t> bf16;
  cuda::encode_on_device(x, e4m3, bf16);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(e4m3[i], float_to_e4m3(x[i])) << "x = " << x[i];
    ASSERT_EQ(bf16[i], float_to_bf16(x[i])) << "x = " << x[i];
  }
}

}  // namespace
}  // namespace dsv4
