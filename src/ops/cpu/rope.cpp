#include "ops/cpu/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/formats.h"

namespace dsv4::cpu {

RopeTable RopeTable::make(int dim, double base, int64_t original_seq_len, double factor,
                          double beta_fast, double beta_slow) {
  RopeTable t;
  t.rope_dim = dim;
  const int half = dim / 2;
  t.inv_freq.resize(half);
  const float fbase = static_cast<float>(base);
  for (int i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(dim);
    t.inv_freq[i] = 1.0f / static_cast<float>(std::pow(double(fbase), double(e)));
  }
  if (original_seq_len > 0) {
    auto correction_dim = [&](double rotations) {
      return dim * std::log(double(original_seq_len) / (rotations * 2 * std::numbers::pi)) /
             (2 * std::log(base));
    };
    double low = std::max(std::floor(correction_dim(beta_fast)), 0.0);
    double high = std::min(std::ceil(correction_dim(beta_slow)), double(dim - 1));
    if (low == high) high += 0.001;
    const float ffactor = static_cast<float>(factor);
    for (int i = 0; i < half; ++i) {
      float ramp = (static_cast<float>(i) - static_cast<float>(low)) /
                   (static_cast<float>(high) - static_cast<float>(low));
      ramp = std::clamp(ramp, 0.0f, 1.0f);
      const float smooth = 1.0f - ramp;
      const float f = t.inv_freq[i];
      t.inv_freq[i] = f / ffactor * (1.0f - smooth) + f * smooth;
    }
  }
  return t;
}

void RopeTable::cos_sin(int64_t pos, float* c, float* s) const {
  const float p = static_cast<float>(pos);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float angle = p * inv_freq[i];
    c[i] = static_cast<float>(std::cos(double(angle)));
    s[i] = static_cast<float>(std::sin(double(angle)));
  }
}

void rope_apply(float* x, int rope_dim, const float* c, const float* s, bool inverse) {
  for (int i = 0; i < rope_dim / 2; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    const float sn = inverse ? -s[i] : s[i];
    x[2 * i] = round_bf16(a * c[i] - b * sn);
    x[2 * i + 1] = round_bf16(a * sn + b * c[i]);
  }
}

}  // namespace dsv4::cpu
