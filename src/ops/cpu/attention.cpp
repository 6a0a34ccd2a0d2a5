#include "ops/cpu/attention.h"

#include <cmath>
#include <limits>
#include <vector>

#include "core/formats.h"
#include "ops/cpu/simd.h"

namespace dsv4::cpu {

void sparse_attention(const SparseAttnParams& p, const float* q, const float* const* keys,
                      int num_keys, float* out) {
  const int D = p.head_dim;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> acc(D), s(kAttnKeyBlock);
  std::vector<double> pv(D);
  for (int h = 0; h < p.n_heads; ++h) {
    const float* qh = q + size_t(h) * D;
    float m = kNegInf, sum = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int b0 = 0; b0 < num_keys; b0 += kAttnKeyBlock) {
      const int nb = std::min(kAttnKeyBlock, num_keys - b0);
      float bm = m;
      for (int j = 0; j < nb; ++j) {
        const float* k = keys[b0 + j];
        if (!k) {
          s[j] = kNegInf;
          continue;
        }
        s[j] = static_cast<float>(dot_f64(qh, k, D)) * p.softmax_scale;
        bm = std::fmax(bm, s[j]);
      }
      if (bm == kNegInf) continue;  // nothing valid yet: the block changes nothing
      const float alpha = std::exp(m - bm);
      float bsum = 0.0f;
      std::fill(pv.begin(), pv.end(), 0.0);
      for (int j = 0; j < nb; ++j) {
        const float e = std::exp(s[j] - bm);
        bsum += e;
        const float pb = p.bf16_probs ? round_bf16(e) : e;
        if (pb == 0.0f) continue;
        const float* k = keys[b0 + j];
        for (int d = 0; d < D; ++d) pv[d] += double(pb) * double(k[d]);
      }
      sum = sum * alpha + bsum;
      for (int d = 0; d < D; ++d) acc[d] = acc[d] * alpha + static_cast<float>(pv[d]);
      m = bm;
    }
    sum += std::exp(p.sink[h] - m);
    float* oh = out + size_t(h) * D;
    for (int d = 0; d < D; ++d) oh[d] = round_bf16(acc[d] / sum);
  }
}

}  // namespace dsv4::cpu
