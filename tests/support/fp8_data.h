// Data for the FP8 linear tests: activations whose 128-wide blocks span the whole range of
// block scales, and the exact values an FP8 weight in checkpoint form stands for.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "core/formats.h"
#include "core/rng.h"
#include "model/weight_quant.h"

namespace dsv4::test {

// BF16 activations [m, k] (k a multiple of 128), one magnitude per 128-wide block: an all-zero
// block (the amax floor) with probability 1/8, else 2^-20 .. 2^11. With `ties`, one block kind
// in eight also puts every fifth element on a multiple of half the magnitude (exact ties of
// the e4m3 grid).
inline std::vector<float> random_block_acts(Rng& rng, int m, int k, bool ties) {
  std::vector<float> x(size_t(m) * k);
  for (int r = 0; r < m; ++r)
    for (int b = 0; b < k / 128; ++b) {
      const int kind = int(rng.below(8));
      const float mag = kind == 0 ? 0.0f : std::ldexp(1.0f, int(rng.below(32)) - 20);
      for (int i = 0; i < 128; ++i) {
        float v = float(rng.normal()) * mag;
        if (ties && kind == 7 && i % 5 == 0) v = mag * 0.5f * float(1 + int(rng.below(30)));
        x[size_t(r) * k + b * 128 + i] = round_bf16(v);
      }
    }
  return x;
}

// [out, in]: each e4m3 code times the UE8M0 scale of its 128 x 128 block (exact in float).
inline std::vector<float> dequantize_fp8(const Fp8Weight& q, int out, int in) {
  const int kb = (in + 127) / 128;
  std::vector<float> w(size_t(out) * in);
  for (int o = 0; o < out; ++o)
    for (int i = 0; i < in; ++i)
      w[size_t(o) * in + i] = e4m3_to_float(q.codes[size_t(o) * in + i]) *
                              e8m0_to_float(q.scales[size_t(o / 128) * kb + i / 128]);
  return w;
}

}  // namespace dsv4::test
