// RMS normalisations in the reference's precision.
#pragma once

namespace dsv4::cpu {

// RMSNorm of each of `m` rows of width `n`: fp32 math, BF16 out:
// y = bf16(w * (x * rsqrt(mean(x^2) + eps))).
void rms_norm(const float* x, int m, int n, const float* weight, float eps, float* y);

// The attention's per-head weightless RMS norm, done in BF16 arithmetic as the reference
// does it on a BF16 tensor: every intermediate (x^2, mean, +eps, rsqrt, product) is rounded
// to BF16. `rows` rows of width n, in place.
void rms_norm_bf16_weightless(float* x, int rows, int n, float eps);

// mean(x^2) over n values, summed in double and rounded to fp32.
float mean_square(const float* x, int n);

}  // namespace dsv4::cpu
