// Manifold-constrained hyper-connections: collapse the hc streams into one sub-layer input
// (hc_pre, with Sinkhorn-normalised mixing), expand a sub-layer output back (hc_post), and
// the final weighted collapse (hc_head). fp32 math; streams are BF16 values.
#pragma once

namespace dsv4::cpu {

struct HcParams {
  int hc = 4;
  int dim = 0;
  int sinkhorn_iters = 20;
  float norm_eps = 1e-6f;
  float hc_eps = 1e-6f;
  const float* fn = nullptr;     // [mix, hc*dim]
  const float* base = nullptr;   // [mix]
  const float* scale = nullptr;  // [3] (pre, post, comb) or [1] for the head
};

// m = (X @ fn^T) * rsqrt(mean(X^2) + eps) for one token's flattened streams X [hc*dim];
// `rows` = number of rows of fn used.
void hc_mixes(const HcParams& p, const float* streams, int rows, float* mixes);

// Sinkhorn normalisation of a hc x hc matrix in place: row softmax + eps, column
// normalisation, then (iters - 1) x (row, column) normalisations.
void sinkhorn(float* comb, int hc, int iters, float eps);

// One token: streams [hc, dim] -> y [dim] (BF16), post [hc], comb [hc, hc] (row j -> col k).
void hc_pre(const HcParams& p, const float* streams, float* y, float* post, float* comb);

// One token: out[k] = bf16(post[k] * x + sum_j comb[j][k] * res[j]); out may not alias res.
void hc_post(int hc, int dim, const float* x, const float* res, const float* post,
             const float* comb, float* out);

// One token: y = bf16(sum_j (sigmoid(m_j * scale + base_j) + eps) * h_j).
void hc_head(const HcParams& p, const float* streams, float* y);

}  // namespace dsv4::cpu
