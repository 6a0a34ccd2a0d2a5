#include "ops/cpu/dequant.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/formats.h"

namespace dsv4::cpu {

std::vector<float> to_float(const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::kBF16) {
    for (size_t i = 0; i < v.size(); ++i) {
      bf16_t b;
      std::memcpy(&b, t.data + 2 * i, 2);
      v[i] = bf16_to_float(b);
    }
  } else if (t.dtype == DType::kF32) {
    std::memcpy(v.data(), t.data, v.size() * 4);
  } else {
    throw Error(cat("tensor '", t.name, "': expected BF16 or F32, got ", dtype_name(t.dtype)));
  }
  return v;
}

std::vector<float> dequant_fp8(const Fp8Ref& r) {
  const TensorView& w = *r.weight;
  const TensorView& s = *r.scale;
  const int64_t out = w.shape[0], in = w.shape[1], sin = s.shape[1];
  std::vector<float> v(size_t(out * in));
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      const uint8_t sc = s.data[(o / 128) * sin + i / 128];
      DSV4_CHECK(sc != 0xff, "tensor '", s.name, "': NaN scale (0xff)");
      v[o * in + i] = e4m3_to_float(w.data[o * in + i]) * e8m0_to_float(sc);
    }
  for (float x : v) DSV4_CHECK(!std::isnan(x), "tensor '", w.name, "': NaN weight");
  return v;
}

std::vector<float> dequant_fp4(const Fp4Ref& r) {
  const TensorView& w = *r.weight;
  const TensorView& s = *r.scale;
  const int64_t out = w.shape[0], in = w.shape[1] * 2, sin = s.shape[1];
  std::vector<float> v(size_t(out * in));
  if (r.format == ExpertFormat::kMxfp4) {
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        const uint8_t byte = w.data[o * (in / 2) + i / 2];
        const uint8_t code = (i % 2) ? e2m1_high(byte) : e2m1_low(byte);
        const uint8_t sc = s.data[o * sin + i / 32];
        DSV4_CHECK(sc != 0xff, "tensor '", s.name, "': NaN scale (0xff)");
        v[o * in + i] = e2m1_to_float(code) * e8m0_to_float(sc);
      }
    return v;
  }
  float g;
  std::memcpy(&g, r.scale_2->data, 4);
  DSV4_CHECK(std::isfinite(g) && g > 0, "tensor '", r.scale_2->name,
             "': weight_scale_2 must be finite and positive, got ", g);
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      const uint8_t byte = w.data[o * (in / 2) + i / 2];
      const uint8_t code = (i % 2) ? e2m1_high(byte) : e2m1_low(byte);
      const float bs = e4m3_to_float(s.data[o * sin + i / 16]);
      DSV4_CHECK(!std::isnan(bs), "tensor '", s.name, "': NaN block scale");
      v[o * in + i] = (e2m1_to_float(code) * bs) * g;
    }
  return v;
}

}  // namespace dsv4::cpu
