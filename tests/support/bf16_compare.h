// The kernel tests' tolerance for BF16 outputs against a CPU reference (issue 3): no NaN,
// relative L2 <= 4e-3 and >= 99 % of the elements within one BF16 ulp (of the larger of the two
// magnitudes); a failure names the first element beyond one ulp.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "support/bf16_vectors.h"

namespace dsv4::test {

struct Bf16Closeness {
  double rel_l2 = 0;
  double within_ulp = 0;        // fraction of elements within 1 BF16 ulp
  double within_ulp_large = 0;  // the same over |ref| >= rms(ref)/16 (diagnostic)
  double exact = 0;             // fraction of elements equal to the reference (diagnostic)
  int64_t nan = 0;
  int64_t first_bad = -1;  // first element beyond 1 ulp (or NaN)
};

inline bool within_one_bf16_ulp(float got, float ref) {
  return std::fabs(double(got) - ref) <=
         1.0001 * bf16_ulp(std::max(std::fabs(got), std::fabs(ref)));
}

inline Bf16Closeness bf16_closeness(const std::vector<float>& got, const std::vector<float>& ref) {
  Bf16Closeness c;
  double num = 0, den = 0;
  int64_t ok = 0, exact = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i])) {
      ++c.nan;
      if (c.first_bad < 0) c.first_bad = int64_t(i);
      continue;
    }
    const double d = double(got[i]) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
    exact += got[i] == ref[i];
    if (within_one_bf16_ulp(got[i], ref[i]))
      ++ok;
    else if (c.first_bad < 0)
      c.first_bad = int64_t(i);
  }
  c.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  c.within_ulp = ref.empty() ? 1.0 : double(ok) / double(ref.size());
  c.exact = ref.empty() ? 1.0 : double(exact) / double(ref.size());
  // The same fraction over the elements not within 1/16 of the RMS of zero, where an error of a
  // fixed fraction of the output scale (the FP8 tensor cores' ~14-bit accumulator) exceeds an
  // ulp of the element itself.
  const double rms = ref.empty() ? 0 : std::sqrt(den / double(ref.size()));
  int64_t big = 0, big_ok = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (std::fabs(ref[i]) >= rms / 16 && !std::isnan(got[i])) {
      ++big;
      big_ok += within_one_bf16_ulp(got[i], ref[i]);
    }
  c.within_ulp_large = big ? double(big_ok) / double(big) : 1.0;
  return c;
}

// Below this many elements one element is >= 1 % of them: the fraction rule would demand that
// every element be within one ulp, which is no derived bound (a caller judges such outputs per
// element against its op's error model instead).
inline constexpr size_t kFractionRuleMinElements = 100;

// Asserts the tolerance; `cols` (the row length) locates the first bad element. judge_fraction
// false: the caller judges every element by a derived bound instead of the fraction within an ulp
// (for outputs of fewer than kFractionRuleMinElements elements).
inline void expect_bf16_close(const std::vector<float>& got, const std::vector<float>& ref,
                              int cols, const std::string& what, bool judge_fraction = true) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const Bf16Closeness c = bf16_closeness(got, ref);
  std::string where;
  if (c.first_bad >= 0)
    where = cat(" first bad [", c.first_bad / cols, ", ", c.first_bad % cols, "]: got ",
                got[c.first_bad], " want ", ref[c.first_bad]);
  EXPECT_EQ(c.nan, 0) << what << ": NaN outputs (poison left?)" << where;
  EXPECT_LE(c.rel_l2, 4e-3) << what << ": relative L2" << where;
  if (judge_fraction) {
    EXPECT_GE(c.within_ulp, 0.99) << what << ": fraction within 1 BF16 ulp" << where;
  }
  std::printf("[ metric ] %s rel_l2=%.3g within_1ulp=%.5f (|ref|>=rms/16: %.5f) exact=%.5f\n",
              what.c_str(), c.rel_l2, c.within_ulp, c.within_ulp_large, c.exact);
}

}  // namespace dsv4::test
