#include "ops/cpu/indexer.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "core/formats.h"
#include "ops/cpu/simd.h"

namespace dsv4::cpu {

void indexer_scores(const float* q, const float* w, int n_heads, int dim, const float* keys,
                    int num_keys, float* scores) {
  for (int t = 0; t < num_keys; ++t) {
    const float* k = keys + size_t(t) * dim;
    float total = 0.0f;
    for (int h = 0; h < n_heads; ++h) {
      const float* qh = q + size_t(h) * dim;
      const float s = std::max(round_bf16(static_cast<float>(dot_f64(qh, k, dim))), 0.0f);
      total += round_bf16(s * w[h]);
    }
    scores[t] = round_bf16(total);
  }
}

int topk_desc(const float* scores, int n, int k, int32_t* out) {
  k = std::min(k, n);
  if (k <= 0) return 0;
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [&](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  std::copy(idx.begin(), idx.begin() + k, out);
  return k;
}

}  // namespace dsv4::cpu
