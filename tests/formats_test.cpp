// Number formats, exhaustively where the format is small, against independent oracles.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "ops/cpu/quant.h"

namespace dsv4 {
namespace {

// Oracle: nearest representable magnitude by exhaustive scan, ties to the even code.
uint8_t nearest_code(double a, const std::vector<double>& mags) {
  int best = 0;
  for (int c = 1; c < int(mags.size()); ++c) {
    const double db = std::fabs(a - mags[best]), dc = std::fabs(a - mags[c]);
    if (dc < db || (dc == db && c % 2 == 0 && best % 2 == 1)) best = c;
  }
  return uint8_t(best);
}

std::vector<double> e4m3_mags() {
  std::vector<double> m;
  for (int c = 0; c < 127; ++c)
    m.push_back(c < 8 ? c / 512.0 : std::ldexp(1.0 + (c & 7) / 8.0, (c >> 3) - 7));
  return m;
}

TEST(E4m3, DecodeTable) {
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
  EXPECT_EQ(e4m3_to_float(0xb8), -1.0f);
}

TEST(E4m3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(uint8_t(c))), c) << c;
  }
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
}

TEST(E4m3, EncodeMatchesNearestEvenOracle) {
  const std::vector<double> mags = e4m3_mags();
  std::vector<float> xs;
  for (size_t c = 0; c + 1 < mags.size(); ++c) {
    const double mid = 0.5 * (mags[c] + mags[c + 1]);
    xs.push_back(float(mid));
    xs.push_back(std::nextafter(float(mid), 0.0f));
    xs.push_back(std::nextafter(float(mid), 1e9f));
  }
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int i = 0; i < 200000; ++i) xs.push_back(u(rng) * std::ldexp(1.0f, int(rng() % 30) - 20));
  for (float x : xs) {
    if (x >= 448.0f) continue;
    const uint8_t want = nearest_code(x, mags);
    ASSERT_EQ(float_to_e4m3(x), want) << "x = " << x;
    ASSERT_EQ(float_to_e4m3(-x), want | 0x80) << "x = " << -x;
  }
  EXPECT_EQ(float_to_e4m3(1000.0f), 0x7e);  // saturates
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
}

TEST(E8m0, EveryCodeRoundTrips) {
  for (int c = 0; c < 255; ++c) {
    const float v = e8m0_to_float(uint8_t(c));
    EXPECT_EQ(v, std::ldexp(1.0f, c - 127)) << c;
    EXPECT_EQ(pow2_to_e8m0(v), c) << c;
  }
  EXPECT_TRUE(std::isnan(e8m0_to_float(0xff)));
}

TEST(E2m1, EveryCodeRoundTripsAndTiesGoEven) {
  const float mag[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1_to_float(uint8_t(c)), (c & 8) ? -mag[c & 7] : mag[c & 7]);
    EXPECT_EQ(float_to_e2m1(e2m1_to_float(uint8_t(c))), c);
  }
  const std::vector<double> mags(mag, mag + 8);
  for (int c = 0; c < 7; ++c) {
    const float mid = 0.5f * (mag[c] + mag[c + 1]);
    EXPECT_EQ(float_to_e2m1(mid), nearest_code(mid, mags)) << mid;
    EXPECT_EQ(float_to_e2m1(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(float_to_e2m1(std::nextafter(mid, 10.0f)), c + 1);
  }
  EXPECT_EQ(float_to_e2m1(0.25f), 0);  // tie between 0 and 0.5 -> even (0)
  EXPECT_EQ(float_to_e2m1(0.75f), 2);  // tie between 0.5 and 1 -> even (1.0)
  EXPECT_EQ(float_to_e2m1(5.0f), 6);   // tie between 4 and 6 -> even (4)
  EXPECT_EQ(float_to_e2m1(100.0f), 7);
  EXPECT_EQ(e2m1_pack(0x3, 0xa), 0xa3);
  EXPECT_EQ(e2m1_low(0xa3), 0x3);
  EXPECT_EQ(e2m1_high(0xa3), 0xa);
}

TEST(Bf16, RoundsToNearestEven) {
  std::mt19937 rng(2);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    if (!std::isfinite(f)) continue;
    // Oracle in double: the two BF16 neighbours and the distance to each.
    const uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    std::memcpy(&flo, &lo, 4);
    std::memcpy(&fhi, &hi, 4);
    // Past the largest BF16 the upper neighbour is infinity, reached at 2^128.
    const double up = std::isinf(fhi) ? std::copysign(std::ldexp(1.0, 128), f) : double(fhi);
    const double dlo = std::fabs(double(f) - flo), dhi = std::fabs(up - f);
    uint32_t want = (dlo < dhi || (dlo == dhi && ((lo >> 16) & 1) == 0)) ? lo : hi;
    ASSERT_EQ(uint32_t(float_to_bf16(f)) << 16, want) << f;
  }
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f)), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Pow2Ceil, MatchesCeilLog2) {
  std::mt19937 rng(3);
  for (int i = 0; i < 100000; ++i) {
    const float v = std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, int(rng() % 200) - 100);
    EXPECT_EQ(pow2_ceil(v), std::ldexp(1.0f, int(std::ceil(std::log2(double(v)))))) << v;
  }
  EXPECT_EQ(pow2_ceil(1.0f), 1.0f);
  EXPECT_EQ(pow2_ceil(0.75f), 1.0f);
  EXPECT_EQ(pow2_ceil(1.0000001f), 2.0f);
}

TEST(BlockQuant, Fp8ScalesAndValues) {
  std::mt19937 rng(4);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> x(256), fq(256);
  for (auto& v : x) v = round_bf16(n(rng) * 3.0f);
  std::vector<uint8_t> codes(256), scales(2);
  cpu::quantize_fp8(x.data(), 256, 128, codes.data(), scales.data());
  cpu::fake_quant_fp8(x.data(), 256, 128, fq.data());
  for (int b = 0; b < 2; ++b) {
    float amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(x[b * 128 + i]));
    const float s = e8m0_to_float(scales[b]);
    EXPECT_GE(s * 448.0f, amax);
    EXPECT_LT(s * 224.0f, amax);  // the smallest power of two that covers amax
    for (int i = b * 128; i < (b + 1) * 128; ++i) {
      EXPECT_EQ(fq[i], e4m3_to_float(codes[i]) * s);
      EXPECT_EQ(fq[i], round_bf16(fq[i]));  // exact in BF16
      EXPECT_LE(std::fabs(fq[i] - x[i]), std::fabs(x[i]) / 16 + s / 512);
    }
  }
  // An all-zero block uses the amax floor 1e-4.
  std::vector<float> z(64, 0.0f);
  EXPECT_EQ(cpu::fp8_block_scale(z.data(), 64), pow2_ceil(1e-4f / 448.0f));
}

TEST(BlockQuant, Fp4PackedMatchesFakeQuant) {
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> x(128), fq(128);
  for (auto& v : x) v = round_bf16(n(rng));
  std::vector<uint8_t> packed(64), scales(4);
  cpu::quantize_fp4(x.data(), 128, 32, packed.data(), scales.data());
  cpu::fake_quant_fp4(x.data(), 128, 32, fq.data());
  for (int i = 0; i < 128; ++i) {
    const uint8_t code = i % 2 ? e2m1_high(packed[i / 2]) : e2m1_low(packed[i / 2]);
    EXPECT_EQ(fq[i], e2m1_to_float(code) * e8m0_to_float(scales[i / 32]));
  }
  EXPECT_THROW(cpu::fake_quant_fp4(x.data(), 100, 32, fq.data()), Error);
}

}  // namespace
}  // namespace dsv4
