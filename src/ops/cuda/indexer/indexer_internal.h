// Shared host-side checks of the indexer stages (indexer.cpp).
#pragma once

#include "ops/cuda/indexer/indexer.h"

namespace dsv4::cuda::indexer_detail {

enum class Stage { kQuery, kLogits, kTopk };

// Throws dsv4::Error naming the first unsupported or inconsistent field used by `stage`.
void validate(const IndexerParams& p, Stage stage);

// The largest visible count per token, from the host-side batch bounds.
int64_t max_visible(const IndexerParams& p);

// How indexer_topk spreads the rows: CTAs a row (a cluster) and entries a thread.
struct TopkPlan {
  int ctas_per_row = 1;
  int keys_per_thread = 8;  // the kernel's register bound (8, 16, 32 or 64), >= per
  int chunk = 0;            // entries a CTA (a multiple of 8), from the longest row
  int per = 0;              // entries a thread (a multiple of 8)
};
TopkPlan topk_plan(const IndexerParams& p);

}  // namespace dsv4::cuda::indexer_detail
