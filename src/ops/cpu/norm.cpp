#include "ops/cpu/norm.h"

#include <cmath>

#include "core/formats.h"

namespace dsv4::cpu {

float mean_square(const float* x, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  return static_cast<float>(s / n);
}

void rms_norm(const float* x, int m, int n, const float* weight, float eps, float* y) {
  for (int r = 0; r < m; ++r) {
    const float* xr = x + size_t(r) * n;
    float* yr = y + size_t(r) * n;
    const float rs = 1.0f / std::sqrt(mean_square(xr, n) + eps);
    for (int i = 0; i < n; ++i) yr[i] = round_bf16(weight[i] * (xr[i] * rs));
  }
}

void rms_norm_bf16_weightless(float* x, int rows, int n, float eps) {
  for (int r = 0; r < rows; ++r) {
    float* xr = x + size_t(r) * n;
    double s = 0.0;
    for (int i = 0; i < n; ++i) s += double(round_bf16(xr[i] * xr[i]));
    const float mean = round_bf16(static_cast<float>(s / n));
    const float t = round_bf16(mean + eps);
    const float rs = round_bf16(1.0f / std::sqrt(t));
    for (int i = 0; i < n; ++i) xr[i] = round_bf16(xr[i] * rs);
  }
}

}  // namespace dsv4::cpu
