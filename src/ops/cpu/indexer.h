// Lightning indexer scoring and top-k selection (CSA layers).
#pragma once

#include <cstdint>

namespace dsv4::cpu {

// score[t] = bf16( sum_h bf16( relu(bf16(q_h . k_t)) * w_h ) ) over `num_keys` keys, the
// reference's BF16 einsum / ReLU / weighting / head sum. q: [n_heads, dim] (FP4-faked BF16
// values), w: [n_heads] BF16 values, keys: [num_keys, dim].
void indexer_scores(const float* q, const float* w, int n_heads, int dim, const float* keys,
                    int num_keys, float* scores);

// The k highest scores' indices in descending score order, ties to the lower index (the
// order the reference's top-k produced). Returns min(k, n).
int topk_desc(const float* scores, int n, int k, int32_t* out);

}  // namespace dsv4::cpu
