// Shared host-side checks of the indexer stages (indexer.cpp).
#pragma once

#include "ops/cuda/indexer/indexer.h"

namespace dsv4::cuda::indexer_detail {

enum class Stage { kQuery, kLogits, kTopk };

// Throws dsv4::Error naming the first unsupported or inconsistent field used by `stage`.
void validate(const IndexerParams& p, Stage stage);

// The largest visible count, the top-k segment length (entries per CTA; rows longer than one
// segment are merged by a second pass) and segments per row, from the host-side batch bounds.
int64_t max_visible(const IndexerParams& p);
int topk_segment_len(const IndexerParams& p);
int num_segments(const IndexerParams& p);
// Whether indexer_topk runs the cluster path (one cluster of CTAs per token).
bool topk_uses_cluster(const IndexerParams& p);

}  // namespace dsv4::cuda::indexer_detail
