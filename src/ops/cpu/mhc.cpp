#include "ops/cpu/mhc.h"

#include <cmath>
#include <vector>

#include "core/formats.h"
#include "ops/cpu/norm.h"

namespace dsv4::cpu {
namespace {

float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

// Weighted collapse sum_j w_j * h_j in fp32, streams in order, rounded to BF16.
void collapse(int hc, int dim, const float* w, const float* streams, float* y) {
  for (int d = 0; d < dim; ++d) {
    float s = w[0] * streams[d];
    for (int j = 1; j < hc; ++j) s += w[j] * streams[size_t(j) * dim + d];
    y[d] = round_bf16(s);
  }
}

}  // namespace

void hc_mixes(const HcParams& p, const float* X, int rows, float* mixes) {
  const int n = p.hc * p.dim;
  const float rs = 1.0f / std::sqrt(mean_square(X, n) + p.norm_eps);
  for (int r = 0; r < rows; ++r) {
    const float* f = p.fn + size_t(r) * n;
    double s = 0.0;
    for (int i = 0; i < n; ++i) s += double(X[i]) * double(f[i]);
    mixes[r] = static_cast<float>(s) * rs;
  }
}

void sinkhorn(float* c, int hc, int iters, float eps) {
  for (int j = 0; j < hc; ++j) {
    float* row = c + j * hc;
    float mx = row[0];
    for (int k = 1; k < hc; ++k) mx = std::fmax(mx, row[k]);
    float sum = 0.0f;
    for (int k = 0; k < hc; ++k) {
      row[k] = std::exp(row[k] - mx);
      sum += row[k];
    }
    for (int k = 0; k < hc; ++k) row[k] = row[k] / sum + eps;
  }
  auto col_norm = [&] {
    for (int k = 0; k < hc; ++k) {
      float s = 0.0f;
      for (int j = 0; j < hc; ++j) s += c[j * hc + k];
      for (int j = 0; j < hc; ++j) c[j * hc + k] = c[j * hc + k] / (s + eps);
    }
  };
  auto row_norm = [&] {
    for (int j = 0; j < hc; ++j) {
      float s = 0.0f;
      for (int k = 0; k < hc; ++k) s += c[j * hc + k];
      for (int k = 0; k < hc; ++k) c[j * hc + k] = c[j * hc + k] / (s + eps);
    }
  };
  col_norm();
  for (int it = 1; it < iters; ++it) {
    row_norm();
    col_norm();
  }
}

void hc_pre(const HcParams& p, const float* streams, float* y, float* post, float* comb) {
  const int hc = p.hc;
  std::vector<float> m((2 + hc) * hc);
  hc_mixes(p, streams, (2 + hc) * hc, m.data());
  std::vector<float> pre(hc);
  for (int j = 0; j < hc; ++j) pre[j] = sigmoid(m[j] * p.scale[0] + p.base[j]) + p.hc_eps;
  for (int j = 0; j < hc; ++j) post[j] = 2.0f * sigmoid(m[hc + j] * p.scale[1] + p.base[hc + j]);
  for (int i = 0; i < hc * hc; ++i) comb[i] = m[2 * hc + i] * p.scale[2] + p.base[2 * hc + i];
  sinkhorn(comb, hc, p.sinkhorn_iters, p.hc_eps);
  collapse(hc, p.dim, pre.data(), streams, y);
}

void hc_post(int hc, int dim, const float* x, const float* res, const float* post,
             const float* comb, float* out) {
  for (int k = 0; k < hc; ++k) {
    float* o = out + size_t(k) * dim;
    for (int d = 0; d < dim; ++d) {
      float s = comb[0 * hc + k] * res[d];
      for (int j = 1; j < hc; ++j) s += comb[j * hc + k] * res[size_t(j) * dim + d];
      o[d] = round_bf16(post[k] * x[d] + s);
    }
  }
}

void hc_head(const HcParams& p, const float* streams, float* y) {
  const int hc = p.hc;
  std::vector<float> m(hc), w(hc);
  hc_mixes(p, streams, hc, m.data());
  for (int j = 0; j < hc; ++j) w[j] = sigmoid(m[j] * p.scale[0] + p.base[j]) + p.hc_eps;
  collapse(hc, p.dim, w.data(), streams, y);
}

}  // namespace dsv4::cpu
