#include "ops/cpu/hadamard.h"

#include <cmath>

#include "core/error.h"
#include "core/formats.h"

namespace dsv4::cpu {

void hadamard_rotate(float* x, int n) {
  DSV4_CHECK(n > 0 && (n & (n - 1)) == 0, "hadamard_rotate: ", n, " is not a power of two");
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float scale = static_cast<float>(1.0 / std::sqrt(double(n)));
  for (int i = 0; i < n; ++i) x[i] = round_bf16(x[i] * scale);
}

}  // namespace dsv4::cpu
