// Rotary position embedding on interleaved pairs (x[2i], x[2i+1]) of the last `rope_dim`
// dims, with per-layer frequency tables (plain for SWA-only layers, YaRN for compressed).
#pragma once

#include <cstdint>
#include <vector>

namespace dsv4::cpu {

struct RopeTable {
  int rope_dim = 0;
  std::vector<float> inv_freq;  // rope_dim/2 fp32 frequencies

  // base^(-2i/d) (fp32), with the YaRN ramp when original_seq_len > 0:
  // f <- f/factor * (1 - smooth) + f * smooth.
  static RopeTable make(int rope_dim, double base, int64_t original_seq_len, double factor,
                        double beta_fast, double beta_slow);
  // cos/sin of float(pos) * f_i for i < rope_dim/2.
  void cos_sin(int64_t pos, float* cos, float* sin) const;
};

// Rotates `x` (rope_dim values, BF16 out) by the angles (inverse: conjugate rotation).
void rope_apply(float* x, int rope_dim, const float* cos, const float* sin, bool inverse);

}  // namespace dsv4::cpu
