// Shared host-side checks of the indexer stages (indexer.cpp).
#pragma once

#include "ops/cuda/indexer/indexer.h"

namespace dsv4::cuda::indexer_detail {

enum class Stage { kQuery, kLogits, kTopk };

// Throws dsv4::Error naming the first unsupported or inconsistent field used by `stage`.
void validate(const IndexerParams& p, Stage stage);

// Top-k segments per row and the largest visible count, from the host-side batch bounds.
int64_t max_visible(const IndexerParams& p);
int num_segments(const IndexerParams& p);

}  // namespace dsv4::cuda::indexer_detail
