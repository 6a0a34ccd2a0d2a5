#include "model/weight_quant.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "core/parallel.h"

namespace dsv4 {
namespace {

// body(r) for every row r in [0, rows), over the host's cores when the tensor is large (real-shape
// random weights). Each row's bytes depend on that row alone: the same output as one thread.
template <typename Body>
void for_each_row(int rows, size_t elems, const Body& body) {
  parallel_for(rows, int64_t(elems) * 4, [&](int64_t r) { body(int(r)); });
}

}  // namespace

Fp8Weight quantize_fp8_weight(const std::vector<float>& w, int out, int in) {
  DSV4_CHECK(w.size() == size_t(out) * in, "quantize_fp8_weight: size mismatch");
  const int bo = (out + 127) / 128, bi = (in + 127) / 128;
  Fp8Weight r;
  r.codes.resize(w.size());
  r.scales.resize(size_t(bo) * bi);
  for_each_row(bo, w.size(), [&](int i) {
    for (int j = 0; j < bi; ++j) {
      float amax = 0;
      for (int o = i * 128; o < std::min(out, (i + 1) * 128); ++o)
        for (int k = j * 128; k < std::min(in, (j + 1) * 128); ++k)
          amax = std::max(amax, std::fabs(w[size_t(o) * in + k]));
      const float s = pow2_ceil(std::max(amax, 1e-30f) * (1.0f / kE4m3Max));
      r.scales[size_t(i) * bi + j] = pow2_to_e8m0(s);
      for (int o = i * 128; o < std::min(out, (i + 1) * 128); ++o)
        for (int k = j * 128; k < std::min(in, (j + 1) * 128); ++k)
          r.codes[size_t(o) * in + k] = float_to_e4m3(w[size_t(o) * in + k] / s);
    }
  });
  return r;
}

Mxfp4Weight quantize_mxfp4_weight(const std::vector<float>& w, int out, int in) {
  DSV4_CHECK(w.size() == size_t(out) * in && in % 32 == 0, "quantize_mxfp4_weight: bad shape");
  Mxfp4Weight r;
  r.packed.assign(size_t(out) * in / 2, 0);
  r.scales.resize(size_t(out) * in / 32);
  for_each_row(out, w.size(), [&](int o) {
    for (int b = 0; b < in / 32; ++b) {
      const float* x = w.data() + size_t(o) * in + b * 32;
      float amax = 0;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(x[k]));
      const float s = pow2_ceil(std::max(amax, 1e-30f) * (1.0f / kE2m1Max));
      r.scales[size_t(o) * (in / 32) + b] = pow2_to_e8m0(s);
      for (int k = 0; k < 32; k += 2) {
        const uint8_t lo = float_to_e2m1(x[k] / s), hi = float_to_e2m1(x[k + 1] / s);
        r.packed[(size_t(o) * in + b * 32 + k) / 2] = e2m1_pack(lo, hi);
      }
    }
  });
  return r;
}

float nvfp4_global_scale(const std::vector<float>& w) {
  float amax = 0;
  for (float x : w) amax = std::max(amax, std::fabs(x));
  return amax / (kE2m1Max * kE4m3Max);
}

Nvfp4Weight quantize_nvfp4_weight(const std::vector<float>& w, int out, int in, float scale_2) {
  DSV4_CHECK(w.size() == size_t(out) * in && in % 16 == 0, "quantize_nvfp4_weight: bad shape");
  DSV4_CHECK(scale_2 > 0 && std::isfinite(scale_2), "quantize_nvfp4_weight: bad global scale");
  Nvfp4Weight r;
  r.scale_2 = scale_2;
  r.packed.assign(size_t(out) * in / 2, 0);
  r.scales.resize(size_t(out) * in / 16);
  for_each_row(out, w.size(), [&](int o) {
    for (int b = 0; b < in / 16; ++b) {
      const float* x = w.data() + size_t(o) * in + b * 16;
      float amax = 0;
      for (int k = 0; k < 16; ++k) amax = std::max(amax, std::fabs(x[k]));
      const uint8_t sc = float_to_e4m3(amax / (kE2m1Max * scale_2));
      r.scales[size_t(o) * (in / 16) + b] = sc;
      const float s = e4m3_to_float(sc) * scale_2;
      for (int k = 0; k < 16; k += 2) {
        const uint8_t lo = s > 0 ? float_to_e2m1(x[k] / s) : 0;
        const uint8_t hi = s > 0 ? float_to_e2m1(x[k + 1] / s) : 0;
        r.packed[(size_t(o) * in + b * 16 + k) / 2] = e2m1_pack(lo, hi);
      }
    }
  });
  return r;
}

}  // namespace dsv4
