#include "ops/cuda/indexer/indexer.h"

#include <algorithm>
#include <cmath>
#include "core/error.h"
#include "ops/cuda/indexer/indexer_config.h"
#include "ops/cuda/indexer/indexer_internal.h"

namespace dsv4::cuda {
namespace indexer_detail {

using namespace indexer_cfg;

int64_t max_visible(const IndexerParams& p) {
  return p.ratio > 0 ? (p.batch.max_position + 1) / p.ratio : 0;
}

int topk_segment_len(const IndexerParams& p) {
  const int64_t n = max_visible(p);
  if (p.batch.num_tokens > kTopkSmallBatch || n <= kTopkMinSplit || p.topk < 1) return kSegment;
  // About sqrt(n k) entries, a multiple of 1024 (>= k), with at most kSegment / k segments so
  // that the merge's candidates fit one segment.
  const int64_t k = p.topk;
  int64_t len =
      (static_cast<int64_t>(std::ceil(std::sqrt(double(n) * double(k)))) + 1023) / 1024 * 1024;
  const int64_t max_segs = kSegment / k;
  len = std::max(len, (n + max_segs - 1) / max_segs);
  return static_cast<int>(std::clamp<int64_t>(len, 1024, kSegment));
}

bool topk_uses_cluster(const IndexerParams& p) {
  switch (p.topk_path) {
    case IndexerTopkPath::kCluster:
      return true;
    case IndexerTopkPath::kSegments:
      return false;
    default:
      return p.batch.num_tokens <= kTopkSmallBatch && max_visible(p) > kTopkMinSplit;
  }
}

int num_segments(const IndexerParams& p) {
  const int64_t len = topk_segment_len(p);
  return static_cast<int>((max_visible(p) + len - 1) / len);
}

void validate(const IndexerParams& p, Stage stage) {
  const AttnBatch& b = p.batch;
  DSV4_CHECK(b.num_seqs >= 0 && b.num_tokens >= 0, "indexer: negative batch size");
  DSV4_CHECK(b.num_tokens == 0 || (b.num_seqs > 0 && b.cu_seqlens && b.seq_pos0),
             "indexer: batch.cu_seqlens / seq_pos0 missing");
  DSV4_CHECK(b.num_tokens == 0 || b.max_seq_tokens >= 1, "indexer: batch.max_seq_tokens unset");
  DSV4_CHECK(b.max_position >= 0, "indexer: batch.max_position < 0");
  DSV4_CHECK(p.head_dim == kHeadDim, "indexer: head_dim ", p.head_dim,
             " unsupported (only 128: Hadamard 128, FP4 blocks of 32)");
  DSV4_CHECK(p.rope_dim == kRopeDim, "indexer: rope_dim ", p.rope_dim, " unsupported (only 64)");
  DSV4_CHECK(p.n_heads >= 1 && p.n_heads <= kMaxHeads, "indexer: n_heads ", p.n_heads,
             " unsupported (1..", kMaxHeads, ")");
  switch (stage) {
    case Stage::kQuery:
      DSV4_CHECK(b.num_tokens == 0 || (p.q && p.wproj && p.inv_freq && p.q_fp4 && p.weights),
                 "indexer_query: q / wproj / inv_freq / q_fp4 / weights missing");
      break;
    case Stage::kLogits:
      DSV4_CHECK(p.ratio > 0, "indexer_logits: ratio must be positive");
      DSV4_CHECK(b.num_tokens == 0 || (p.q_fp4 && p.weights && p.scores),
                 "indexer_logits: q_fp4 / weights / scores missing");
      DSV4_CHECK(p.score_stride >= max_visible(p), "indexer_logits: score_stride ", p.score_stride,
                 " < visible entries ", max_visible(p));
      DSV4_CHECK(max_visible(p) == 0 || (p.keys.pages && p.keys.block_table),
                 "indexer_logits: key store missing");
      DSV4_CHECK(p.keys.data_bytes == kKeyBytes && p.keys.scale_bytes == kKeyScales,
                 "indexer_logits: key store is not the MXFP4 128-dim layout (", p.keys.data_bytes,
                 " + ", p.keys.scale_bytes, " bytes per entry)");
      DSV4_CHECK(p.keys.page_size > 0 && p.keys.page_bytes % 16 == 0,
                 "indexer_logits: key pages must be 16-byte multiples");
      DSV4_CHECK(reinterpret_cast<uintptr_t>(p.keys.pages) % 16 == 0,
                 "indexer_logits: key pages must be 16-byte aligned");
      break;
    case Stage::kTopk:
      DSV4_CHECK(p.ratio > 0, "indexer_topk: ratio must be positive");
      DSV4_CHECK(p.topk >= 1 && p.topk <= kIndexerMaxTopk, "indexer_topk: topk ", p.topk,
                 " unsupported (1..", kIndexerMaxTopk, ")");
      DSV4_CHECK(max_visible(p) <= kIndexerMaxVisible, "indexer_topk: ", max_visible(p),
                 " visible entries exceed the supported ", kIndexerMaxVisible);
      DSV4_CHECK(b.num_tokens == 0 || (p.scores && p.topk_idx),
                 "indexer_topk: scores / topk_idx missing");
      DSV4_CHECK(p.score_stride >= max_visible(p), "indexer_topk: score_stride ", p.score_stride,
                 " < visible entries ", max_visible(p));
      DSV4_CHECK(p.workspace_bytes >= indexer_workspace_bytes(p) &&
                     (indexer_workspace_bytes(p) == 0 || p.workspace),
                 "indexer_topk: workspace of ", p.workspace_bytes, " bytes < ",
                 indexer_workspace_bytes(p));
      break;
  }
}

}  // namespace indexer_detail

size_t indexer_workspace_bytes(const IndexerParams& p) {
  using namespace indexer_cfg;
  // Per token and segment: up to topk candidates of (ordered score key, entry index). Enough
  // for any launch of at most num_tokens tokens and max_position: the large-batch segments of
  // kSegment entries, and the small-batch split (at most kSegment / topk segments of topk
  // candidates for each of at most kTopkSmallBatch tokens), whichever needs more.
  const int64_t n = indexer_detail::max_visible(p);
  const int64_t T = p.batch.num_tokens;
  const int64_t full_segs = (n + kSegment - 1) / kSegment;
  size_t bytes = full_segs > 1 ? size_t(T) * full_segs * size_t(p.topk) * 2 * sizeof(uint32_t) : 0;
  if (n > kTopkMinSplit && p.topk >= 1)
    bytes = std::max(bytes, size_t(std::min<int64_t>(T, kTopkSmallBatch)) *
                                size_t(kSegment / p.topk) * size_t(p.topk) * 2 * sizeof(uint32_t));
  return bytes;
}

void lightning_indexer(const IndexerParams& p, cudaStream_t stream) {
  indexer_query(p, stream);
  IndexerParams next = p;  // the stages after the first follow a kernel of this op
  next.pdl = true;
  indexer_logits(next, stream);
  indexer_topk(next, stream);
}

}  // namespace dsv4::cuda
