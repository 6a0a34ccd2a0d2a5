#include "ops/cuda/indexer/indexer.h"

#include "core/error.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/indexer/indexer_config.h"
#include "ops/cuda/indexer/indexer_internal.h"

namespace dsv4::cuda {
namespace indexer_detail {

using namespace indexer_cfg;

int64_t max_visible(const IndexerParams& p) {
  return p.ratio > 0 ? (p.batch.max_position + 1) / p.ratio : 0;
}

TopkPlan topk_plan(const IndexerParams& p) {
  const int64_t n = max_visible(p);
  const int64_t T = p.batch.num_tokens;
  // Entries a CTA holds at c CTAs a row (chunks are multiples of 8 entries).
  auto chunk = [n](int c) { return ((n + c - 1) / c + 7) / 8 * 8; };
  // Entries a thread (a multiple of 8, as the kernel computes it).
  auto per = [&](int c) { return ((chunk(c) + kTopkThreads - 1) / kTopkThreads + 7) / 8 * 8; };
  TopkPlan plan;
  int c = p.topk_ctas_per_row;
  if (c == 0) {
    // Within the grid budget, the fewest entries a thread (a CTA's time is its threads' loop
    // length), ties to fewer CTAs; then more CTAs while threads would hold more than
    // kTopkPreferKpt. A row just past a multiple of 4096 entries (the engine's 16385 at 64K
    // context) thus takes the cluster that keeps 8 entries a thread instead of doubling them.
    c = 1;
    for (int cc = 2; cc <= kTopkMaxCluster && T * cc <= int64_t(kTopkCtasPerSm) * sm_count();
         cc *= 2)
      if (per(cc) < per(c)) c = cc;
    while (c < kTopkMaxCluster && per(c) > kTopkPreferKpt) c *= 2;
  }
  DSV4_CHECK(c == 1 || c == 2 || c == 4 || c == 8, "indexer_topk: ", c,
             " CTAs a row unsupported (1, 2, 4 or 8)");
  int kpt = kTopkMinKpt;
  while (kpt < kTopkMaxKpt && per(c) > kpt) kpt *= 2;
  DSV4_CHECK(per(c) <= kpt, "indexer_topk: ", n, " visible entries do not fit ", c, " CTAs a row");
  plan.ctas_per_row = c;
  plan.keys_per_thread = kpt;
  plan.chunk = int(chunk(c));
  plan.per = int(per(c));
  return plan;
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
      break;
  }
}

}  // namespace indexer_detail

void lightning_indexer(const IndexerParams& p, cudaStream_t stream) {
  indexer_query(p, stream);
  IndexerParams next = p;  // the stages after the first follow a kernel of this op
  next.pdl = true;
  indexer_logits(next, stream);
  indexer_topk(next, stream);
}

}  // namespace dsv4::cuda
