#include "core/formats.h"

#include <array>
#include <cmath>
#include <limits>

namespace dsv4 {
namespace {

std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) {
    int sign = c >> 7, exp = (c >> 3) & 0xf, man = c & 7;
    float v;
    if (exp == 0xf && man == 7) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (exp == 0) {
      v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
    } else {
      v = std::ldexp(1.0f + man / 8.0f, exp - 7);
    }
    t[c] = sign ? -v : v;
  }
  return t;
}

const std::array<float, 256> kE4m3Table = make_e4m3_table();
constexpr std::array<float, 8> kE2m1Mag = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// Nearest-even rounding of a non-negative finite `a` onto an ascending table of
// representable magnitudes whose index parity equals the code's mantissa parity.
int round_to_table(float a, const float* mags, int n) {
  if (a >= mags[n - 1]) return n - 1;
  int lo = 0, hi = n - 1;  // mags[lo] <= a < mags[hi]
  while (hi - lo > 1) {
    int mid = (lo + hi) / 2;
    if (mags[mid] <= a)
      lo = mid;
    else
      hi = mid;
  }
  // Midpoints of adjacent values are exact in float (one more bit is enough).
  float m = 0.5f * (mags[lo] + mags[hi]);
  if (a < m) return lo;
  if (a > m) return hi;
  return (lo % 2 == 0) ? lo : hi;
}

}  // namespace

float e4m3_to_float(uint8_t code) {
  return kE4m3Table[code];
}

uint8_t float_to_e4m3(float x) {
  if (std::isnan(x)) return 0x7f;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  bits &= 0x7fffffffu;
  float a;
  std::memcpy(&a, &bits, 4);
  if (a >= kE4m3Max) return sign | 0x7e;  // saturate (no infinities in e4m3fn)
  if (a < 0.015625f) {
    // Subnormal grid of 2^-9: scaling by 512 is exact; nearbyint rounds half to even.
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f)));
  }
  // Normal: keep 3 of 23 mantissa bits, round half to even; a carry bumps the exponent.
  const int e = static_cast<int>(bits >> 23) - 127 + 7;
  const uint32_t mant = bits & 0x7fffffu;
  uint32_t m3 = (mant + 0x7ffffu + ((mant >> 20) & 1u)) >> 20;
  int ee = e;
  if (m3 == 8) m3 = 0, ++ee;
  return static_cast<uint8_t>(sign | (ee << 3) | m3);
}

float e8m0_to_float(uint8_t code) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 255; ++c) t[c] = std::ldexp(1.0f, c - 127);
    t[255] = std::numeric_limits<float>::quiet_NaN();
    return t;
  }();
  return table[code];
}

uint8_t pow2_to_e8m0(float x) {
  int e;
  float m = std::frexp(x, &e);  // x = m * 2^e, m in [0.5, 1)
  (void)m;
  int code = (e - 1) + 127;
  if (code < 0) code = 0;
  if (code > 254) code = 254;
  return static_cast<uint8_t>(code);
}

float e2m1_to_float(uint8_t code) {
  float v = kE2m1Mag[code & 7];
  return (code & 8) ? -v : v;
}

uint8_t float_to_e2m1(float x) {
  if (std::isnan(x)) return 0x7;  // no NaN in e2m1: saturate
  uint8_t sign = std::signbit(x) ? 0x8 : 0x0;
  return static_cast<uint8_t>(sign | round_to_table(std::fabs(x), kE2m1Mag.data(), 8));
}

float pow2_ceil(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  int exp = static_cast<int>((bits >> 23) & 0xff);
  uint32_t man = bits & 0x7fffffu;
  int e = exp - 127 + (man != 0 ? 1 : 0);
  uint32_t out = static_cast<uint32_t>(e + 127) << 23;
  float r;
  std::memcpy(&r, &out, 4);
  return r;
}

}  // namespace dsv4
