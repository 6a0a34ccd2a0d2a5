#include "ops/cpu/simd.h"

namespace dsv4::cpu {

DSV4_MULTIVERSION
void axpy_f64(double* acc, double a, const float* w, int n) {
  for (int i = 0; i < n; ++i) acc[i] += a * static_cast<double>(w[i]);
}

DSV4_MULTIVERSION
double dot_f64(const float* a, const float* b, int n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += double(a[i + j]) * double(b[i + j]);
  double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}

}  // namespace dsv4::cpu
