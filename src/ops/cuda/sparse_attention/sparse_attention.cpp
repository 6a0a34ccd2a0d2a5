// Host side of the sparse attention: validation, the planner's inputs and dispatch.
#include "ops/cuda/sparse_attention/sparse_attention.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/per_device.h"
#include "ops/cuda/sparse_attention/sparse_attention_config.h"
#include "ops/cuda/sparse_attention/sparse_attention_heuristics.h"
#include "ops/cuda/sparse_attention/sparse_attention_internal.h"

namespace dsv4::cuda {
namespace {

using namespace sparse_attn_cfg;
using sparse_attn_detail::AttnArgs;
using sparse_attn_detail::kPartialFloats;
static_assert(kPartialFloats * sizeof(float) == sparse_attn_heuristics::kPartialBytes,
              "the cost model's partial size");

bool aligned(const void* p, size_t a) {
  return reinterpret_cast<uintptr_t>(p) % a == 0;
}

void check_kv_store(const PagedStoreView& v, const char* name) {
  DSV4_CHECK(v.pages && v.block_table, "sparse_attention: ", name, " pages / block table missing");
  DSV4_CHECK(v.data_bytes == kEntryData && v.scale_bytes == kEntryScales,
             "sparse_attention: ", name, " is not the 584-byte KV layout (", v.data_bytes, " + ",
             v.scale_bytes, ")");
  DSV4_CHECK(v.page_size > 0 && v.page_bytes % 16 == 0 && aligned(v.pages, 16),
             "sparse_attention: ", name, " pages must be 16-byte aligned multiples");
}

void validate(const SparseAttnParams& p) {
  const AttnBatch& b = p.batch;
  DSV4_CHECK(b.num_seqs >= 0 && b.num_tokens >= 0, "sparse_attention: negative batch size");
  DSV4_CHECK(b.num_tokens == 0 || (b.num_seqs > 0 && b.cu_seqlens && b.seq_pos0),
             "sparse_attention: batch.cu_seqlens / seq_pos0 missing");
  DSV4_CHECK(b.max_position >= 0, "sparse_attention: batch.max_position < 0");
  DSV4_CHECK(p.head_dim == kHeadDim, "sparse_attention: head_dim ", p.head_dim,
             " unsupported (only 512 = 448 FP8 + 64 BF16)");
  DSV4_CHECK(p.n_heads == 4 || p.n_heads == 8 ||
                 (p.n_heads % 16 == 0 && p.n_heads >= 16 && p.n_heads <= 256),
             "sparse_attention: n_heads ", p.n_heads,
             " unsupported (4, 8 or a multiple of 16 up to 256)");
  DSV4_CHECK(std::isfinite(p.softmax_scale) && p.softmax_scale > 0,
             "sparse_attention: softmax_scale must be positive");
  DSV4_CHECK(p.window >= 1 && p.window <= kMaxWindow, "sparse_attention: window ", p.window,
             " unsupported (1..", kMaxWindow, ")");
  DSV4_CHECK(p.ratio == 0 || p.ratio == 4 || p.ratio == 128, "sparse_attention: ratio ", p.ratio,
             " unsupported (0, 4 or 128)");
  DSV4_CHECK(p.heads_per_cta == 0 || p.heads_per_cta == 16 || p.heads_per_cta == 32 ||
                 p.heads_per_cta == 64,
             "sparse_attention: heads_per_cta ", p.heads_per_cta, " unsupported (16, 32, 64)");
  DSV4_CHECK(p.heads_per_cta <= std::max(16, (p.n_heads + 15) / 16 * 16),
             "sparse_attention: heads_per_cta ", p.heads_per_cta, " exceeds n_heads ", p.n_heads);
  DSV4_CHECK(p.num_splits >= 0, "sparse_attention: num_splits < 0");
  if (is_wgmma(p.kernel)) {
    DSV4_CHECK(p.n_heads % 64 == 0,
               "sparse_attention: the wgmma kernel needs n_heads a multiple of 64 (got ", p.n_heads,
               ")");
    DSV4_CHECK(p.heads_per_cta == 0 || p.heads_per_cta == 64,
               "sparse_attention: the wgmma kernel takes 64 heads per CTA (got ", p.heads_per_cta,
               ")");
    DSV4_CHECK(sparse_attn_detail::wgmma_available(),
               "sparse_attention: the wgmma kernel was built without the CuTe headers");
  }
  if (b.num_tokens == 0) return;
  DSV4_CHECK(p.q && p.out && p.sink, "sparse_attention: q / out / sink missing");
  DSV4_CHECK(aligned(p.q, 16) && aligned(p.out, 16),
             "sparse_attention: q / out must be 16-byte aligned");
  check_kv_store(p.window_cache, "window_cache");
  DSV4_CHECK((p.staged_data == nullptr) == (p.staged_scales == nullptr),
             "sparse_attention: staged_data and staged_scales go together");
  DSV4_CHECK(aligned(p.staged_data, 16) && aligned(p.staged_scales, 8),
             "sparse_attention: staged entries must be 16-byte (data) / 8-byte (scales) aligned");
  if (p.ratio != 0) check_kv_store(p.comp_cache, "comp_cache");
  if (p.ratio == 4) {
    DSV4_CHECK(p.topk >= 0 && p.topk <= kMaxTopk, "sparse_attention: topk ", p.topk,
               " unsupported (0..", kMaxTopk, ")");
    DSV4_CHECK(p.topk == 0 || (p.topk_idx && p.topk_stride >= p.topk),
               "sparse_attention: topk_idx missing or topk_stride < topk");
  }
}

int max_key_blocks(const SparseAttnParams& p) {
  int64_t ncomp = 0;
  if (p.ratio == 4) ncomp = p.topk;
  if (p.ratio == 128) ncomp = (p.batch.max_position + 1) / 128;
  return int((p.window + ncomp + kKeyBlock - 1) / kKeyBlock);
}

// Compressed-entry rows per sequence among the predecoded keys: every entry a token at
// batch.max_position can see.
int comp_rows_of(const SparseAttnParams& p) {
  return p.ratio == 0 ? 0 : int((p.batch.max_position + 1) / p.ratio);
}

SparseAttnShape shape_of(const SparseAttnParams& p) {
  SparseAttnShape shape;
  shape.num_tokens = p.batch.num_tokens;
  shape.n_heads = p.n_heads;
  shape.max_key_blocks = max_key_blocks(p);
  shape.sm_count = sm_count();
  shape.wgmma_available = sparse_attn_detail::wgmma_available();
  shape.num_seqs = p.batch.num_seqs;
  shape.predecode_rows = sparse_attn_detail::predecode_rows(p.batch.num_tokens, p.batch.num_seqs,
                                                            p.window, comp_rows_of(p));
  shape.workspace_offered = p.workspace != nullptr ? int64_t(p.workspace_bytes) : 0;
  shape.kernel = p.kernel;
  shape.heads_per_cta = p.heads_per_cta;
  shape.num_splits = p.num_splits;
  return shape;
}

}  // namespace

SparseAttnShape sparse_attention_shape(const SparseAttnParams& p) {
  validate(p);
  return shape_of(p);
}

SparseAttnPlan sparse_attention_plan(const SparseAttnParams& p) {
  validate(p);
  return plan_sparse_attention(shape_of(p));
}

size_t sparse_attention_workspace_bytes(const SparseAttnParams& p) {
  validate(p);
  const SparseAttnShape shape = shape_of(p);
  return size_t(sparse_attention_workspace(shape, plan_sparse_attention(shape)).total());
}

void sparse_attention(const SparseAttnParams& p, cudaStream_t stream) {
  validate(p);
  const SparseAttnShape shape = shape_of(p);
  const SparseAttnPlan plan = plan_sparse_attention(shape);
  if (p.batch.num_tokens == 0) return;
  const SparseAttnWorkspace wl = sparse_attention_workspace(shape, plan);
  const size_t ws = size_t(wl.total());
  DSV4_CHECK(p.workspace_bytes >= ws && (ws == 0 || (p.workspace && aligned(p.workspace, 16))),
             "sparse_attention: workspace of ", p.workspace_bytes, " bytes < ", ws, " needed");
  AttnArgs a{};
  a.q = p.q;
  a.out = p.out;
  a.sink = p.sink;
  a.scale_log2 = static_cast<float>(double(p.softmax_scale) * 1.4426950408889634);
  a.cu_seqlens = p.batch.cu_seqlens;
  a.seq_pos0 = p.batch.seq_pos0;
  a.num_seqs = p.batch.num_seqs;
  a.num_tokens = p.batch.num_tokens;
  a.n_heads = p.n_heads;
  a.head_tiles = (p.n_heads + plan.heads_per_cta - 1) / plan.heads_per_cta;
  a.window = p.window;
  a.win = p.window_cache;
  a.staged_data = p.staged_data;
  a.staged_scales = p.staged_scales;
  a.ratio = p.ratio;
  a.comp = p.comp_cache;
  a.topk_idx = p.topk_idx;
  a.topk = p.ratio == 4 ? p.topk : 0;
  a.topk_stride = p.topk_stride;
  a.num_splits = plan.num_splits;
  a.blocks_per_split = plan.blocks_per_split;
  a.partials = static_cast<float*>(p.workspace);
  a.pdl = p.pdl;
  a.keys_bf16 = nullptr;
  a.comp_rows = comp_rows_of(p);
  if (wl.keys_bytes > 0)
    a.keys_bf16 =
        reinterpret_cast<__nv_bfloat16*>(static_cast<uint8_t*>(p.workspace) + wl.keys_offset);
  DSV4_CHECK(int64_t(a.num_tokens) * a.head_tiles < (int64_t(1) << 31),
             "sparse_attention: too many (token, head tile) units");
  using sparse_attn_detail::WgProducer;
  if (plan.kernel == SparseAttnKernel::kWgmmaPredecoded) {
    // The rows first; the attention kernel launches programmatically after them (it waits for
    // the pass to complete before its first read).
    sparse_attn_detail::launch_predecode(a, stream);
    a.pdl = true;
    sparse_attn_detail::launch_wgmma(a, WgProducer::kPredecoded, false, stream);
  } else if (is_wgmma(plan.kernel)) {
    sparse_attn_detail::launch_wgmma(
        a,
        plan.kernel == SparseAttnKernel::kWgmmaDirect ? WgProducer::kDirect : WgProducer::kStaged,
        plan.kernel != SparseAttnKernel::kWgmmaUnpaired, stream);
  } else
    sparse_attn_detail::launch_mma(a, plan.heads_per_cta, stream);
  if (plan.num_splits > 1) sparse_attn_detail::launch_combine(a, stream);
}

}  // namespace dsv4::cuda
