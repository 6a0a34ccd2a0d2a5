#include "backends/cuda/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>

#include "backends/cuda/glue.h"
#include "backends/cuda/parallel_moe.h"
#include "backends/cuda/verify.h"
#include "core/error.h"
#include "core/formats.h"
#include "model/memory_plan.h"
#include "ops/cuda/attn_frontend/attn_frontend.h"
#include "ops/cuda/attn_output/attn_output.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/compressor/compressor.h"
#include "ops/cuda/gemm/bf16_stream_linear.h"
#include "ops/cuda/gemm/fp8_gemm.h"
#include "ops/cuda/gemm/fp8_gemm_config.h"
#include "ops/cuda/gemm/w8a16_linear.h"
#include "ops/cuda/head/head.h"
#include "ops/cuda/indexer/indexer.h"
#include "ops/cuda/mhc/mhc.h"
#include "ops/cuda/moe/moe.h"
#include "ops/cuda/norm/norm.h"
#include "ops/cuda/sparse_attention/sparse_attention.h"
// The split-KV partial size, to bound the attention scratch (the public API sizes one launch).
#include "ops/cuda/sparse_attention/sparse_attention_config.h"
#include "ops/cuda/sparse_attention/sparse_attention_internal.h"

namespace dsv4 {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kKvEntry = 584;  // KvEntryLayout{}.entry_bytes()

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

// Largest workspace of the FP8 GEMM over 1 <= m <= m_max for one weight shape (the tensor-core
// path's stream-K partials depend on the number of 128-row tiles; from 65 to 256 rows the path
// depends on m, so the tensor-core figure is taken there).
size_t gemm_ws_upto(int m_max, int n, int k) {
  size_t best = cuda::fp8_gemm_workspace_bytes(m_max, n, k);
  for (int m = cuda::gemm_cfg::kStreamMaxTokens + 1; m < m_max; m += cuda::gemm_cfg::kPrefillTileM)
    best = std::max(best, cuda::fp8_gemm_workspace_bytes(m, n, k, cuda::Fp8GemmPath::kTensorCore));
  return best;
}

cuda::HcShape hc_shape(const ModelConfig& c) {
  cuda::HcShape s;
  s.hc = c.hc_mult;
  s.dim = c.dim;
  s.sinkhorn_iters = c.hc_sinkhorn_iters;
  s.norm_eps = c.norm_eps;
  s.hc_eps = c.hc_eps;
  return s;
}

}  // namespace

CudaModel::CudaModel(DeviceContext& ctx, const ModelConfig& config, CudaModelWeights weights,
                     const CudaModelLimits& limits)
    : cfg_(config),
      w_(std::move(weights)),
      limits_(limits),
      ctx_(ctx),
      stream_(ctx.stream()),
      blas_(&ctx.blas()) {
  cfg_.validate();
  check_cuda_supported(cfg_);
  DSV4_CHECK(int(w_.blocks.size()) == cfg_.num_blocks(), "CUDA weights hold ", w_.blocks.size(),
             " blocks, config ", cfg_.num_blocks());
  DSV4_CHECK(limits.max_tokens >= 1 && limits.max_seqs >= 1 && limits.max_context >= 1 &&
                 limits.max_logit_rows >= 0,
             "CUDA model: bad limits");
  if (limits_.max_logit_rows == 0 || limits_.max_logit_rows > limits_.max_tokens)
    limits_.max_logit_rows = limits_.max_tokens;
  plan(limits_);
  std::vector<int32_t> c(size_t(2) * limits.max_tokens, 0);
  std::iota(c.begin(), c.begin() + limits.max_tokens, 0);
  consts_ = DeviceBuffer<int32_t>(c);
  iota_ = consts_.data();
  zeros_ = consts_.data() + limits.max_tokens;
  // The side branches' stream: the least priority, so that the critical path's CTAs (the
  // context's stream has the greatest) are placed first wherever both wait for an SM.
  int least = 0, greatest = 0;
  DSV4_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  DSV4_CUDA_CHECK(cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, least));
  DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&qi_done_, cudaEventDisableTiming));
  DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&comp_done_, cudaEventDisableTiming));
}

CudaModel::~CudaModel() {
  set_block_timing(false);
  cudaStreamSynchronize(stream_);
  cudaStreamSynchronize(side_);
  cudaEventDestroy(fork_);
  cudaEventDestroy(join_);
  cudaEventDestroy(qi_done_);
  cudaEventDestroy(comp_done_);
  cudaStreamDestroy(side_);
}

bool CudaModel::branches(int tokens) const {
  return tokens >= 1 && limits_.concurrent_branches && observer_ == nullptr && rank_ == nullptr &&
         !limits_.exact_linears && tokens <= cuda::gemm_cfg::kStreamMaxTokens;
}

void CudaModel::fork_side() {
  DSV4_CUDA_CHECK(cudaEventRecord(fork_, stream_));
  DSV4_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
}

void CudaModel::join_side() {
  DSV4_CUDA_CHECK(cudaEventRecord(join_, side_));
  DSV4_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_, 0));
}

void CudaModel::plan(const CudaModelLimits& lim) {
  const ModelConfig& c = cfg_;
  const int64_t T = lim.max_tokens, hc = c.hc_mult, dim = c.dim, H = c.n_heads, D = c.head_dim;
  const int64_t HI = c.index_n_heads, DI = c.index_head_dim > 0 ? c.index_head_dim : 128;
  const int64_t inter = c.moe_inter_dim, G = c.o_groups, OL = c.o_lora_rank;
  bool csa = false, mtp = c.n_mtp_layers > 0;
  comp_ld_ = 0;
  // HA: the most heads attention runs (the heads padded to a count the kernels take, which
  // exceeds the model's below 4 heads); q and o hold that many per token.
  int64_t HA = H;
  for (const CudaBlockWeights& b : w_.blocks) {
    comp_ld_ = std::max<int64_t>(comp_ld_, b.comp_rows);
    csa |= b.ratio == 4;
    HA = std::max<int64_t>(HA, b.attn_heads);
  }
  score_stride_ = csa ? (lim.max_context / 4 + 8) / 8 * 8 : 0;
  act_m_max_ = mtp ? T * hc : T;
  act_k_max_ = std::max<int64_t>({dim, c.q_lora_rank, G * OL, inter});

  // Workspaces.
  size_t gemm_ws = 0;
  for (const CudaBlockWeights& b : w_.blocks) {
    for (const CudaFp8Linear* l : {&b.wq_a, &b.wq_b, &b.wkv, &b.wo_b, &b.index_wq_b, &b.shared_w13,
                                   &b.shared_w1, &b.shared_w3, &b.shared_w2})
      if (!l->empty()) gemm_ws = std::max(gemm_ws, gemm_ws_upto(int(T), l->n, l->k));
    if (b.has_mtp) {
      gemm_ws = std::max(gemm_ws, gemm_ws_upto(int(T), b.e_proj.n, b.e_proj.k));
      gemm_ws = std::max(gemm_ws, gemm_ws_upto(int(T * hc), b.h_proj.n, b.h_proj.k));
    }
  }
  size_t moe_ws = 0;
  {
    const cuda::moe::MoeDeviceWeights& mw = w_.blocks[0].moe;
    const int top_k = c.n_activated_experts;
    for (int m = 1; m <= std::min<int64_t>(T, 4096); ++m)
      moe_ws = std::max(moe_ws, cuda::moe::moe_workspace_bytes(mw, m, top_k));
    moe_ws = std::max(moe_ws, cuda::moe::moe_workspace_bytes(mw, int(T), top_k));
  }
  // Split-KV scratch: at most every key block a split, bounded by the configured budget
  // (attention() caps the splits of a launch to what fits).
  {
    const int64_t ncomp = std::max<int64_t>(csa ? c.index_topk : 0, lim.max_context / 128);
    const int64_t blocks = (c.window_size + ncomp + 63) / 64;
    const int64_t need = T * HA * blocks * cuda::sparse_attn_detail::kPartialFloats * 4;
    act_.attn_split_bytes = size_t(std::min<int64_t>(need, lim.attn_workspace_bytes));
    act_.attn_ws_bytes = act_.attn_split_bytes;
    // Room for a one-sequence prefill chunk's predecoded keys at the planned context, so that
    // prefill takes that kernel at every context (sparse_attention.h: kAuto plans within the
    // workspace offered); memory_plan.cpp counts the same bytes.
    if (HA % 64 == 0 && T >= 16)
      act_.attn_ws_bytes = std::max<size_t>(act_.attn_ws_bytes,
                                            size_t(predecoded_keys_bytes(c, T, lim.max_context)));
  }
  act_.gemm_ws_bytes = gemm_ws;
  act_.moe_ws_bytes = moe_ws;

  // Carve (twice: sizes, then pointers).
  auto carve = [&](uint8_t* base) {
    size_t off = 0;
    auto take = [&](size_t bytes) -> uint8_t* {
      uint8_t* p = base ? base + off : nullptr;
      off += align256(std::max<size_t>(bytes, 1));
      return p;
    };
    auto bf = [&](int64_t n) { return reinterpret_cast<bf16*>(take(size_t(n) * 2)); };
    auto f32 = [&](int64_t n) { return reinterpret_cast<float*>(take(size_t(n) * 4)); };
    ActPtrs& a = act_;
    for (int i = 0; i < 2; ++i) {
      a.streams[i] = bf(T * hc * dim);
      a.post[i] = f32(T * hc);
      a.comb[i] = f32(T * hc * hc);
      a.cs[i] = reinterpret_cast<float2*>(take(size_t(T) * 32 * sizeof(float2)));
    }
    a.x = bf(T * dim);
    a.sub_out = bf(T * dim);
    a.qr = bf(T * c.q_lora_rank);
    a.qr_n = bf(T * c.q_lora_rank);
    a.q = bf(T * HA * D);
    a.kv = bf(T * D);
    a.staging = take(size_t(KvEntryLayout{}.page_bytes(int(T))));
    a.staged = take(size_t(T) * kKvEntry);
    a.comp = f32(T * comp_ld_);
    a.qi = bf(csa ? T * HI * DI : 0);
    a.q_fp4 = bf(csa ? T * HI * DI : 0);
    a.wproj = bf(csa ? T * HI : 0);
    a.iw = bf(csa ? T * HI : 0);
    a.scores = bf(T * score_stride_);
    a.topk = reinterpret_cast<int32_t*>(take(size_t(csa ? T * c.index_topk : 0) * 4));
    a.o = bf(T * HA * D);
    a.z = bf(T * G * OL);
    a.gu = bf(T * 2 * inter);
    a.sact = bf(T * inter);
    a.shared = bf(T * dim);
    const int64_t R = lim.max_logit_rows;
    a.rows = bf(R * hc * dim);
    a.head_y = bf(R * dim);
    a.logits = f32(R * c.vocab_size);
    a.e = bf(mtp ? T * dim : 0);
    a.e_n = bf(mtp ? T * dim : 0);
    a.ep = bf(mtp ? T * dim : 0);
    a.h_n = bf(mtp ? T * hc * dim : 0);
    a.hp = bf(mtp ? T * hc * dim : 0);
    for (int i = 0; i < 2; ++i) {
      a.act_xq[i] = bf(limits_.exact_linears ? act_m_max_ * act_k_max_ : 0);
      a.act_codes[i] = take(size_t(act_m_max_ * act_k_max_));
      a.act_scales[i] = f32((act_k_max_ / 128) * cuda::fp8_scale_ld(int(act_m_max_)));
    }
    a.gemm_ws = take(a.gemm_ws_bytes);
    a.moe_ws = take(a.moe_ws_bytes);
    a.attn_ws = take(a.attn_ws_bytes);
    return off;
  };
  act_bytes_ = int64_t(carve(nullptr));
  carve(ctx_.allocate(size_t(act_bytes_)));
}

void CudaModel::add_observer(OpObserver* o) {
  observers_.add(o);
  observer_ = observers_.empty() ? nullptr : &observers_;
}

void CudaModel::remove_observer(OpObserver* o) {
  observers_.remove(o);
  observer_ = observers_.empty() ? nullptr : &observers_;
}

void CudaModel::set_verifier(CudaVerifier* v) {
  remove_observer(verifier_);
  verifier_ = v;
  if (v) v->set_exact_linears(limits_.exact_linears);
  add_observer(v);
}

void CudaModel::set_trace(TraceSink* t) {
  remove_observer(tracer_.get());
  tracer_.reset();
  if (!t) return;
  const cudaStream_t s = stream_;
  tracer_ = std::make_unique<TraceObserver>(
      *t,
      [s](void* dst, const void* src, size_t bytes) {
        DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
        if (bytes) DSV4_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
      },
      cfg_.hc_mult, cfg_.dim);
  add_observer(tracer_.get());
}

void CudaModel::begin_step(const DeviceStep& st) {
  if (!observer_) return;
  OpEvent e{OpKind::kStepBegin};
  e.chunks = &st.chunks;
  e.tokens = st.num_tokens;
  observer_->after(e);
}

OpEvent CudaModel::linear_event(int block, LinearId id, const bf16* x, int64_t ldx, int m,
                                int64_t in, const void* y, int64_t ldy, int64_t out,
                                bool y_f32) const {
  return op_event(
      OpKind::kLinear, block, int(id),
      {bf16_ref(x, m, in, ldx), y_f32 ? f32_ref(y, m, out, ldy) : bf16_ref(y, m, out, ldy)});
}

void CudaModel::set_block_timing(bool on) {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  events_.clear();
  if (!on) return;
  events_.resize(size_t(cfg_.n_layers) + 2);
  for (cudaEvent_t& e : events_) DSV4_CUDA_CHECK(cudaEventCreate(&e));
}

std::vector<float> CudaModel::block_times_ms() const {
  std::vector<float> t;
  for (size_t i = 0; i + 1 < events_.size(); ++i) {
    float ms = 0;
    DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
    t.push_back(ms);
  }
  return t;
}

// ---- FP8 linears ---------------------------------------------------------------------------

CudaModel::Fp8Act CudaModel::quantize(const bf16* x, int64_t ldx, int m, int k, int slot,
                                      bool pdl) {
  DSV4_CHECK(m <= act_m_max_ && k <= act_k_max_, "activation quantisation of [", m, ", ", k,
             "] exceeds the planned [", act_m_max_, ", ", act_k_max_, "]");
  cuda::ActQuantParams q;
  q.x = x;
  q.m = m;
  q.k = k;
  q.ldx = ldx;
  q.codes = act_.act_codes[slot];
  q.scales_t = act_.act_scales[slot];
  q.ld_scales = cuda::fp8_scale_ld(m);
  // The kernel waits for its producer's completion before reading x; the GEMM after it launches
  // early in turn (programmatic dependent launch across the layer's dense kernels).
  q.pdl = pdl;
  if (slot == 0) x_fp8_ = false;
  if (limits_.exact_linears) {
    // The exact path multiplies the decoded (BF16) quantised activations instead of the codes.
    cuda::fake_quant_act_bf16(x, ldx, m, k, act_.act_xq[slot], stream_);
    return {nullptr, nullptr, 0, m, act_.act_xq[slot], k, x, ldx};
  }
  cuda::quantize_act_fp8(q, stream_);
  return {q.codes, q.scales_t, q.ld_scales, m, nullptr, 0, x, ldx};
}

CudaModel::Fp8Act CudaModel::fused_act(const bf16* x, int64_t ldx, int m, int k, int slot) const {
  DSV4_CHECK(m <= act_m_max_ && k <= act_k_max_, "activation quantisation of [", m, ", ", k,
             "] exceeds the planned [", act_m_max_, ", ", act_k_max_, "]");
  return {
      act_.act_codes[slot], act_.act_scales[slot], cuda::fp8_scale_ld(m), m, nullptr, 0, x, ldx};
}

CudaModel::Fp8Act CudaModel::sublayer_act(const bf16* x, int m, bool pdl) {
  if (pdl && x == act_.x && x_fp8_) return fused_act(x, cfg_.dim, m, cfg_.dim, 0);
  return quantize(x, cfg_.dim, m, cfg_.dim, 0, pdl);
}

cuda::FusedQuant CudaModel::x_quant(int m) {
  x_fp8_ =
      !limits_.exact_linears && cfg_.dim % 128 == 0 && m <= act_m_max_ && cfg_.dim <= act_k_max_;
  cuda::FusedQuant q;
  if (!x_fp8_) return q;
  q.codes = act_.act_codes[0];
  q.scales_t = act_.act_scales[0];
  q.ld_scales = cuda::fp8_scale_ld(m);
  return q;
}

void CudaModel::gemm2(const Fp8Act& a, const GemmOut& o0, const GemmOut& o1, int block, int only) {
  const auto launch = [&] {
    if (limits_.exact_linears) {
      if (only != 1) gemm(a, *o0.w, o0.y, o0.ldy, true);
      if (only != 0) gemm(a, *o1.w, o1.y, o1.ldy, true);
      return;
    }
    cuda::Fp8GemmGroupedParams g;
    g.a_codes = a.codes;
    g.a_scales_t = a.scales_t;
    g.a_ld_scales = a.ld;
    g.m = a.m;
    g.count = 2;
    const GemmOut* outs[2] = {&o0, &o1};
    for (int i = 0; i < 2; ++i) {
      g.w[i] = outs[i]->w->view();
      g.y[i] = outs[i]->y;
      g.ldy[i] = outs[i]->ldy;
    }
    g.workspace = act_.gemm_ws;
    g.workspace_bytes = act_.gemm_ws_bytes;
    g.pdl = true;
    g.only = only;
    cuda::fp8_gemm_grouped(g, stream_);
  };
  if (block < 0) return launch();
  const OpEvent ev[2] = {
      linear_event(block, o0.id, a.x, a.ldx, a.m, o0.w->k, o0.y, o0.ldy, o0.w->n, false),
      linear_event(block, o1.id, a.x, a.ldx, a.m, o1.w->k, o1.y, o1.ldy, o1.w->n, false)};
  op(ev + (only == 1 ? 1 : 0), ev + (only == 0 ? 1 : 2), launch);
}

void CudaModel::gemm(const Fp8Act& a, const CudaFp8Linear& w, bf16* y, int64_t ldy, bool pdl,
                     int block, LinearId id) {
  if (block >= 0) {  // one op: observed as linear `id` of the block
    op(linear_event(block, id, a.x, a.ldx, a.m, w.k, y, ldy, w.n, false),
       [&] { gemm(a, w, y, ldy, pdl); });
    return;
  }
  if (limits_.exact_linears) {
    DSV4_CHECK(a.xq != nullptr && w.scale_rows.size() > 0,
               "exact linears: the weight has no prepared scale rows (n = ", w.n,
               " not a multiple of 128)");
    cuda::W8A16LinearParams p;
    p.x = a.xq;
    p.ldx = a.k;
    p.m = a.m;
    p.n = w.n;
    p.k = w.k;
    p.w = w.codes.data();
    p.w_scale = w.scale_e8m0.data();
    p.scale_rows = reinterpret_cast<const bf16*>(w.scale_rows.data());
    p.y = y;
    p.ldy = ldy;
    p.quantize = false;
    cuda::w8a16_linear(p, stream_);
    return;
  }
  cuda::Fp8GemmParams g;
  g.a_codes = a.codes;
  g.a_scales_t = a.scales_t;
  g.a_ld_scales = a.ld;
  g.m = a.m;
  g.w = w.view();
  g.y = y;
  g.ldy = ldy;
  g.workspace = act_.gemm_ws;
  g.workspace_bytes = act_.gemm_ws_bytes;
  // The streaming GEMM loads only weights before griddepcontrol.wait, so it may follow any kernel
  // programmatically (fp8_gemm.h); every engine call site passes true.
  g.pdl = pdl;
  cuda::fp8_gemm(g, stream_);
}

// ---- step preparation ------------------------------------------------------------------------

void CudaModel::rope_tables(const DeviceStep& st) {
  DSV4_CHECK(st.num_tokens <= limits_.max_tokens && st.num_seqs <= limits_.max_seqs, "step of ",
             st.num_tokens, " tokens / ", st.num_seqs, " sequences exceeds the plan (",
             limits_.max_tokens, " / ", limits_.max_seqs, ")");
  DSV4_CHECK(st.max_position < limits_.max_context, "position ", st.max_position,
             " beyond the planned context of ", limits_.max_context);
  for (int i = 0; i < 2; ++i) {
    cuda::RopeTableParams r;
    r.positions = st.positions;
    r.inv_freq = i ? w_.inv_freq_yarn.data() : w_.inv_freq_plain.data();
    r.num_tokens = st.num_tokens;
    r.cos_sin = act_.cs[i];
    cuda::rope_cos_sin(r, stream_);
  }
}

// ---- mHC -------------------------------------------------------------------------------------

void CudaModel::hc_pre(int block, bool ffn, const DeviceStep& st, const bf16* streams) {
  const CudaBlockWeights& b = w_.blocks[block];
  cuda::HcPreParams p;
  p.shape = hc_shape(cfg_);
  p.tokens = st.num_tokens;
  p.streams = streams;
  p.unit = ffn ? b.hc_ffn.params() : b.hc_attn.params();
  p.norm.weight = ffn ? b.ffn_norm.ptr() : b.attn_norm.ptr();
  p.norm.eps = cfg_.norm_eps;
  p.y = act_.x;
  p.post = act_.post[pp_];
  p.comb = act_.comb[pp_];
  p.quant = x_quant(st.num_tokens);
  const int T = st.num_tokens, hc = cfg_.hc_mult;
  op(op_event(OpKind::kHcPre, block, ffn,
              {bf16_ref(streams, T, hc * cfg_.dim), bf16_ref(p.y, T, cfg_.dim),
               f32_ref(p.post, T, hc), f32_ref(p.comb, T, hc * hc)}),
     [&] { cuda::hc_pre(p, stream_); });
}

// out = hc_post(sub_out) into the other streams buffer; then, when next_block >= 0, hc_pre of
// (next_block, next_ffn) fused into the same pass.
void CudaModel::hc_post(int block, bool ffn, const DeviceStep& st, const bf16* sub_out,
                        int next_block, bool next_ffn) {
  const int T = st.num_tokens, hc = cfg_.hc_mult, dim = cfg_.dim;
  cuda::HcPostParams q;
  q.shape = hc_shape(cfg_);
  q.tokens = T;
  q.x = sub_out;
  q.res = act_.streams[cur_];
  q.post = act_.post[pp_];
  q.comb = act_.comb[pp_];
  q.out = act_.streams[cur_ ^ 1];
  OpEvent e =
      op_event(OpKind::kHcPost, block, ffn,
               {bf16_ref(sub_out, T, dim), bf16_ref(q.res, T, hc * dim), f32_ref(q.post, T, hc),
                f32_ref(q.comb, T, hc * hc), bf16_ref(q.out, T, hc * dim)});
  if (next_block < 0) {
    op(e, [&] { cuda::hc_post(q, stream_); });
    cur_ ^= 1;
    return;
  }
  const CudaBlockWeights& nb = w_.blocks[next_block];
  cuda::HcPostPreParams p;
  p.post = q;
  p.unit = next_ffn ? nb.hc_ffn.params() : nb.hc_attn.params();
  p.norm.weight = next_ffn ? nb.ffn_norm.ptr() : nb.attn_norm.ptr();
  p.norm.eps = cfg_.norm_eps;
  p.y = act_.x;
  p.next_post = act_.post[pp_ ^ 1];
  p.next_comb = act_.comb[pp_ ^ 1];
  p.quant = x_quant(T);
  e.next_block = next_block;
  e.next_ffn = next_ffn;
  e.t[5] = bf16_ref(p.y, T, dim);
  e.t[6] = f32_ref(p.next_post, T, hc);
  e.t[7] = f32_ref(p.next_comb, T, hc * hc);
  op(e, [&] { cuda::hc_post_pre(p, stream_); });
  cur_ ^= 1;
  pp_ ^= 1;
}

// ---- attention ---------------------------------------------------------------------------------

int64_t CudaModel::attn_splits_for(int tokens, int heads) const {
  // Split rows the scratch holds for this launch: (token, head, split) partials.
  const int64_t per = int64_t(cuda::sparse_attn_detail::kPartialFloats) * 4;
  return int64_t(act_.attn_split_bytes) / (per * std::max(1, tokens) * heads);
}

void CudaModel::attention(int block, const DeviceStep& st, DeviceCache& cache, const bf16* x,
                          bf16* out) {
  const ModelConfig& c = cfg_;
  const CudaBlockWeights& b = w_.blocks[block];
  // H: this rank's heads (all of them on one rank); HA: the heads attention runs (H padded with
  // zero queries to a count the sparse attention takes; a tensor-parallel share may need it).
  const int T = st.num_tokens, H = b.heads, HA = b.attn_heads, D = c.head_dim, QL = c.q_lora_rank;
  const int ratio = b.ratio;
  const float2* cs = act_.cs[ratio > 0 ? 1 : 0];
  const int64_t Tmax = limits_.max_tokens;
  if (HA != H)  // the padding heads' queries: zero (wq_b writes the real heads' columns)
    DSV4_CUDA_CHECK(cudaMemset2DAsync(act_.q + int64_t(H) * D, size_t(HA) * D * 2, 0,
                                      size_t(HA - H) * D * 2, size_t(T), stream_));

  // Decode-sized steps: the compressors' projections and the compressors (they read only x) on
  // the side stream beside the q path, joined before the indexer and the attention read them.
  // CSA layers with every indexer head here (split_q): the indexer's query projection first on
  // the main stream, then wq_b and the q front end follow the compressors on the side stream
  // while the indexer (query, logits, top-k: short kernels in series) runs on the main one.
  const bool side = ratio > 0 && T <= cuda::kBf16StreamMaxM && branches(T);
  const bool index_grouped = ratio == 4 && b.index_wq_b.n == c.index_n_heads * c.index_head_dim;
  const bool split_q = side && index_grouped;
  if (side) fork_side();

  // The q and window KV projections share the quantised x (one grouped launch); then q_norm,
  // with the quantisation of its output fused in.
  // (Tensor parallel pads the heads with a memset just before: a fresh quantisation launched
  // without PDL follows it, as every kernel after a non-kernel op does.)
  const Fp8Act ax = sublayer_act(x, T, HA == H);
  gemm2(ax, {&b.wq_a, act_.qr, QL, LinearId::kWqA}, {&b.wkv, act_.kv, D, LinearId::kWkv}, block);
  cuda::RmsNormParams rn;
  rn.x = act_.qr;
  rn.rows = T;
  rn.n = QL;
  rn.weight = b.q_norm.ptr();
  rn.eps = c.norm_eps;
  rn.y = act_.qr_n;
  rn.pdl = true;
  const bool fuse_q = !limits_.exact_linears && QL % 128 == 0;
  if (fuse_q) {
    rn.q_codes = act_.act_codes[1];
    rn.q_scales_t = act_.act_scales[1];
    rn.q_ld_scales = cuda::fp8_scale_ld(T);
  }
  op(op_event(OpKind::kRmsNorm, block, int(NormId::kQNorm),
              {bf16_ref(act_.qr, T, QL), bf16_ref(act_.qr_n, T, QL)}),
     [&] { cuda::rms_norm(rn, stream_); });
  const Fp8Act aq = fuse_q ? fused_act(act_.qr_n, QL, T, QL, 1) : quantize(act_.qr_n, QL, T, QL, 1);
  // The indexer's queries come from the same quantised latent: with wq_b through the grouped
  // GEMM (one rank holding every indexer head; tensor parallel below), which launches them
  // together only where that is predicted faster (plan_stream_grouping); split_q: each weight
  // alone with the bits of that call (only = 0: wq_b, 1: the indexer's).
  const GemmOut q_out{&b.wq_b, act_.q, int64_t(HA) * D, LinearId::kWqB};
  const GemmOut qi_out{&b.index_wq_b, act_.qi, int64_t(c.index_n_heads) * c.index_head_dim,
                       LinearId::kIndexWqB};
  if (split_q) {
    gemm2(aq, q_out, qi_out, block, 1);
    DSV4_CUDA_CHECK(cudaEventRecord(qi_done_, stream_));
  }
  const bool direct = st.decode_only;  // the window entries straight into the ring (below)
  // wq_b and the front end (q_norm_rope + the window KV entries).
  const auto q_path = [&] {
    if (split_q)
      gemm2(aq, q_out, qi_out, block, 0);
    else if (index_grouped)
      gemm2(aq, q_out, qi_out, block);
    else
      gemm(aq, b.wq_b, act_.q, int64_t(HA) * D, true, block, LinearId::kWqB);
    cuda::QNormRopeParams qp;
    qp.q = act_.q;
    qp.out = act_.q;
    qp.cos_sin = cs;
    qp.num_tokens = T;
    qp.num_heads = HA;
    qp.eps = c.norm_eps;
    qp.pdl = true;  // after the wq_b GEMM

    // Window KV entries. One token per sequence: straight into the ring (its slot held position
    // p - window, outside every query's window). Otherwise staged: a staging page the attention
    // reads (entry t at slot t) and packed entries inserted into the ring after attention.
    cuda::KvInsertParams kp;
    kp.kv = act_.kv;
    kp.norm_weight = b.kv_norm.ptr();
    kp.cos_sin = cs;
    kp.eps = c.norm_eps;
    kp.num_tokens = T;
    kp.pdl = true;  // after the GEMMs, in q_norm_rope's launch
    if (direct) {
      kp.token_seq = st.token_seq;
      kp.positions = st.positions;
      kp.window = c.window_size;
      kp.cache =
          cache.window_view(block, st.table(PageKind::kWindow), st.table_stride(PageKind::kWindow));
    } else {
      // Staging "store": one page of Tmax slots, every token of sequence row 0 at slot = its
      // batch index (positions = iota, window = Tmax).
      kp.token_seq = zeros_;
      kp.positions = iota_;
      kp.window = int(Tmax);
      kp.cache = cuda::kv_store_view(act_.staging, int(Tmax), zeros_, 1);
      kp.staged = act_.staged;
    }
    // q_norm_rope and the window KV entries in one launch (both read only what the GEMMs wrote);
    // observed as the two ops. Observers see the real heads (row stride HA heads).
    op({op_event(OpKind::kQNormRope, block, 0,
                 {bf16_ref(act_.q, T, int64_t(H) * D, int64_t(HA) * D)}),
        op_event(OpKind::kKvEntries, block, 0,
                 {bf16_ref(act_.kv, T, D), u8_ref(direct ? nullptr : act_.staged, T, kKvEntry)})},
       [&] { cuda::q_norm_rope_kv_insert(qp, kp, stream_); });
  };
  if (!split_q) q_path();

  // Compressors (and indexer keys) before attention.
  bool wproj_done = false;  // weights_proj ran with the compressors' projection
  if (ratio > 0) {
    std::optional<OnSide> on_side;
    if (side) on_side.emplace(*this);
    // One GEMM of the stacked projections [wkv; wgate (; indexer wkv; wgate)]: one event each.
    const int mw = b.main_width, iw = b.index_width;
    auto proj = [&](LinearId id, int64_t off, int width) {
      return linear_event(block, id, x, c.dim, T, c.dim, act_.comp + off, comp_ld_, width, true);
    };
    // Decode-sized steps: one weight-streaming launch for the stacked projections and, on CSA
    // layers with every indexer head on this rank, the indexer's weights_proj (same x); larger
    // steps: cuBLAS, weights_proj with the indexer below.
    const bool stream_proj = T <= cuda::kBf16StreamMaxM;
    wproj_done = stream_proj && index_grouped;
    const auto launch = [&] {
      if (!stream_proj)
        return blas_->linear(x, c.dim, T, b.comp_proj.ptr(), b.comp_rows, c.dim, act_.comp,
                             comp_ld_, true, stream_);
      cuda::Bf16StreamLinearParams lp;
      lp.x = x;
      lp.ldx = c.dim;
      lp.m = T;
      lp.k = c.dim;
      lp.out[0] = {b.comp_proj.ptr(), b.comp_rows, act_.comp, comp_ld_, true};
      if (wproj_done) {
        lp.out[1] = {b.weights_proj.ptr(), c.index_n_heads, act_.wproj, c.index_n_heads, false};
        lp.count = 2;
      }
      lp.pdl = true;
      cuda::bf16_stream_linear(lp, stream_);
    };
    OpEvent events[5] = {proj(LinearId::kCompWkv, 0, mw), proj(LinearId::kCompWgate, mw, mw)};
    int n = 2;
    if (ratio == 4) {
      events[n++] = proj(LinearId::kIndexCompWkv, 2 * mw, iw);
      events[n++] = proj(LinearId::kIndexCompWgate, 2 * mw + iw, iw);
    }
    if (wproj_done)
      events[n++] = linear_event(block, LinearId::kWeightsProj, x, c.dim, T, c.dim, act_.wproj,
                                 c.index_n_heads, c.index_n_heads, false);
    op(events, events + n, launch);
    for (bool indexer : {false, true}) {
      if (indexer && ratio != 4) continue;
      cuda::CompressorParams cp;
      cp.ratio = indexer ? 4 : ratio;
      cp.dim = indexer ? (c.index_head_dim) : D;
      cp.indexer = indexer;
      const int64_t a_off = indexer ? 2 * b.main_width : 0;
      const int width = indexer ? b.index_width : b.main_width;
      cp.a = act_.comp + a_off;
      cp.g = act_.comp + a_off + width;
      cp.a_stride = comp_ld_;
      cp.g_stride = comp_ld_;
      cp.ape = indexer ? b.index_ape.data() : b.main_ape.data();
      cp.norm_weight = indexer ? b.index_norm.ptr() : b.main_norm.ptr();
      cp.inv_freq = w_.inv_freq(ratio);
      cp.eps = c.norm_eps;
      cp.num_seqs = st.num_seqs;
      cp.num_tokens = T;
      cp.max_seq_tokens = st.max_seq_tokens;
      cp.cu_seqlens = st.cu_seqlens;
      cp.start_pos = st.seq_pos0;
      cp.state_slot = st.state_slot;
      cp.states = indexer ? cache.index_states(block) : cache.main_states(block);
      const PageKind kind = indexer || ratio == 4 ? PageKind::kC4 : PageKind::kC128;
      cp.store = indexer ? cache.index_view(block, st.table(kind), st.table_stride(kind))
                         : cache.compressed_view(block, st.table(kind), st.table_stride(kind));
      cp.pdl = true;  // after the projection's GEMM, or the other compressor
      op(op_event(OpKind::kCompressor, block, indexer,
                  {f32_ref(cp.a, T, width, comp_ld_), f32_ref(cp.g, T, width, comp_ld_)}),
         [&] { cuda::compressor_forward(cp, stream_); });
    }
    if (split_q) {  // still on the side stream: then wq_b and the front end there
      DSV4_CUDA_CHECK(cudaEventRecord(comp_done_, stream_));
      DSV4_CUDA_CHECK(cudaStreamWaitEvent(stream_, qi_done_, 0));
      q_path();
    }
  }
  if (split_q)  // the indexer reads the compressors' keys and weights_proj
    DSV4_CUDA_CHECK(cudaStreamWaitEvent(stream_, comp_done_, 0));
  else if (side)
    join_side();

  // Lightning indexer (CSA).
  if (ratio == 4) {
    const int HI = c.index_n_heads, DI = c.index_head_dim;
    // Tensor parallel: every rank scores with all heads, gathered in head order.
    const int HIl = b.index_wq_b.n / DI;
    if (HIl != HI) {  // (no observers with several ranks)
      gemm(aq, b.index_wq_b, tp_mine_, int64_t(HIl) * DI, true);
      tp_gather(tp_mine_, T, HIl * DI, act_.qi);
      blas_->linear(x, c.dim, T, b.weights_proj.ptr(), HIl, c.dim, tp_mine_, HIl, false, stream_);
      tp_gather(tp_mine_, T, HIl, act_.wproj);
    } else if (!wproj_done) {
      // index_wq_b ran with wq_b (index_grouped).
      op(linear_event(block, LinearId::kWeightsProj, x, c.dim, T, c.dim, act_.wproj, HI, HI, false),
         [&] {
           blas_->linear(x, c.dim, T, b.weights_proj.ptr(), HI, c.dim, act_.wproj, HI, false,
                         stream_);
         });
    }
    cuda::IndexerParams ip;
    ip.batch = st.attn_batch();
    ip.n_heads = HI;
    ip.head_dim = DI;
    ip.rope_dim = c.rope_head_dim;
    ip.ratio = 4;
    ip.topk = c.index_topk;
    ip.q = act_.qi;
    ip.wproj = act_.wproj;
    ip.inv_freq = w_.inv_freq(4);
    ip.keys = cache.index_view(block, st.table(PageKind::kC4), st.table_stride(PageKind::kC4));
    ip.q_fp4 = act_.q_fp4;
    ip.weights = act_.iw;
    ip.scores = act_.scores;
    ip.score_stride = score_stride_;
    ip.topk_idx = act_.topk;
    ip.pdl = HIl == HI;  // after the compressors (tensor parallel: after a gather)
    op(op_event(OpKind::kIndexer, block, 0,
                {bf16_ref(act_.qi, T, int64_t(HI) * DI), bf16_ref(act_.wproj, T, HI),
                 bf16_ref(act_.q_fp4, T, int64_t(HI) * DI), bf16_ref(act_.iw, T, HI),
                 bf16_ref(act_.scores, T, score_stride_, score_stride_),
                 i32_ref(act_.topk, T, c.index_topk)}),
       [&] { cuda::lightning_indexer(ip, stream_); });
  }

  if (split_q) join_side();  // q and the window entry, from the side stream

  // Sparse attention over the window (+ staged chunk) and the compressed entries.
  cuda::SparseAttnParams sp;
  sp.batch = st.attn_batch();
  sp.n_heads = HA;
  sp.head_dim = D;
  sp.softmax_scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  sp.sink = b.sink.data();
  sp.q = act_.q;
  sp.out = act_.o;
  sp.window = c.window_size;
  sp.window_cache =
      cache.window_view(block, st.table(PageKind::kWindow), st.table_stride(PageKind::kWindow));
  if (!direct) {
    sp.staged_data = act_.staging;
    sp.staged_scales = act_.staging + Tmax * KvEntryLayout{}.data_bytes();
  }
  sp.ratio = ratio;
  if (ratio > 0) {
    const PageKind kind = ratio == 4 ? PageKind::kC4 : PageKind::kC128;
    sp.comp_cache = cache.compressed_view(block, st.table(kind), st.table_stride(kind));
  }
  if (ratio == 4) {
    sp.topk_idx = act_.topk;
    sp.topk = c.index_topk;
    sp.topk_stride = c.index_topk;
  }
  sp.workspace = act_.attn_ws;
  sp.workspace_bytes = act_.attn_ws_bytes;
  sp.pdl = true;  // after the indexer, the compressors or the front end
  {
    const cuda::SparseAttnPlan plan = cuda::sparse_attention_plan(sp);
    const int64_t fits = attn_splits_for(T, HA);
    // Fewer key splits when the planned ones do not fit the scratch (long contexts at
    // mid-size batches); the split count changes only the order of the fp32 combine.
    if (plan.num_splits > 1 && plan.num_splits > fits)
      sp.num_splits = int(std::max<int64_t>(1, fits));
  }
  op(op_event(OpKind::kAttention, block, 0,
              {bf16_ref(act_.q, T, int64_t(H) * D, int64_t(HA) * D),
               u8_ref(direct ? nullptr : act_.staging, Tmax, 0),
               i32_ref(ratio == 4 ? act_.topk : nullptr, T, c.index_topk),
               bf16_ref(act_.o, T, int64_t(H) * D, int64_t(HA) * D)}),
     [&] { cuda::sparse_attention(sp, stream_); });

  // Output path: inverse RoPE + grouped wo_a, then wo_b.
  cuda::WoAParams wp;
  wp.o = act_.o;
  if (HA != H) {  // the real heads' outputs, compacted into the (spent) query buffer
    DSV4_CUDA_CHECK(cudaMemcpy2DAsync(act_.q, size_t(H) * D * 2, act_.o, size_t(HA) * D * 2,
                                      size_t(H) * D * 2, size_t(T), cudaMemcpyDeviceToDevice,
                                      stream_));
    wp.o = act_.q;
  }
  wp.cos_sin = cs;
  wp.num_tokens = T;
  wp.num_heads = H;
  // Tensor parallel: this rank's groups, then wo_b whole on every rank's (its sums are the
  // one-rank sums).
  const int Gl = b.wo_a.n / c.o_lora_rank;
  wp.o_groups = Gl;
  wp.o_lora = c.o_lora_rank;
  wp.w = b.wo_a.codes.data();
  wp.w_scale = b.wo_a.scale_e8m0.data();
  wp.w_scale_rows = b.wo_a_scale_rows.ptr();
  wp.z = Gl != c.o_groups ? tp_mine_ : act_.z;
  wp.pdl = HA == H;  // after the attention (padded heads: after the compacting copy)
  const int GOL = c.o_groups * c.o_lora_rank;
  op(op_event(OpKind::kWoA, block, 0, {bf16_ref(act_.z, T, GOL)}), [&] {
    cuda::attn_output_wo_a(wp, stream_);
    if (Gl != c.o_groups) tp_gather(tp_mine_, T, Gl * c.o_lora_rank, act_.z);
  });
  const Fp8Act az = quantize(act_.z, GOL, T, GOL, 0, Gl == c.o_groups);
  gemm(az, b.wo_b, out, c.dim, true, block, LinearId::kWoB);

  // The chunk's window entries go into the ring last.
  if (!direct) {
    cuda::KvInsertStagedParams ins;
    ins.staged = act_.staged;
    ins.num_tokens = T;
    ins.token_seq = st.insert_seq;
    ins.positions = st.positions;
    ins.window = c.window_size;
    ins.cache =
        cache.window_view(block, st.table(PageKind::kWindow), st.table_stride(PageKind::kWindow));
    op(op_event(OpKind::kWindowInsert, block, 0, {u8_ref(act_.staged, T, kKvEntry)}),
       [&] { cuda::kv_insert_staged(ins, stream_); });
  }
}

// ---- MoE ---------------------------------------------------------------------------------------

void CudaModel::moe(int block, const DeviceStep& st, const bf16* x, bf16* out) {
  const ModelConfig& c = cfg_;
  const CudaBlockWeights& b = w_.blocks[block];
  const int T = st.num_tokens, inter = b.shared_inter;
  cuda::moe::MoeArgs m;
  m.x = x;
  m.tokens = st.tokens;
  m.shared = act_.shared;
  m.y = out;
  m.m = T;
  m.p.top_k = c.n_activated_experts;
  m.p.score_func = c.score_func;
  m.p.route_scale = c.route_scale;
  m.p.swiglu_limit = c.swiglu_limit;
  m.workspace = act_.moe_ws;
  m.workspace_bytes = act_.moe_ws_bytes;
  m.stream = stream_;
  if ((limits_.moe_tiled_path != cuda::moe::MoeGemmPath::kTiled || limits_.moe_tiled_tile != 0) &&
      cuda::moe::moe_gemm_choice(b.moe, T, m.p.top_k).path != cuda::moe::MoeGemmPath::kStream) {
    m.gemm_path = limits_.moe_tiled_path;
    m.tile_n = limits_.moe_tiled_tile;
  }
  // Decode-sized steps: the shared expert on the side stream beside the routed experts, joined
  // before their combine reads its output. The router and the plan are launched first: launched
  // after the shared expert, they found its GEMMs (and the kernels those had launched early)
  // holding every SM and ran after it (H200, e2e_depth_bench's kernel trace).
  const bool side = !pmoe_ && branches(T);
  constexpr unsigned kRoute = cuda::moe::kStageRoute | cuda::moe::kStagePlan;
  if (side) {
    fork_side();
    m.stages = kRoute;
    cuda::moe::moe_forward(b.moe, m);
    m.stages = cuda::moe::kStageAll & ~kRoute;
    m.shared_ready = join_;
  }
  std::optional<OnSide> on_side;
  if (side) on_side.emplace(*this);
  // Shared expert: [w1; w3] -> SwiGLU -> w2.
  const Fp8Act ax = sublayer_act(x, T, true);
  op({linear_event(block, LinearId::kSharedW1, x, c.dim, T, c.dim, act_.gu, 2 * inter, inter,
                   false),
      linear_event(block, LinearId::kSharedW3, x, c.dim, T, c.dim, act_.gu + inter, 2 * inter,
                   inter, false)},
     [&] {
       if (b.shared_fused) {
         gemm(ax, b.shared_w13, act_.gu, 2 * inter, true);
       } else {
         // inter not a multiple of 128: two weights, still one grouped launch.
         gemm2(ax, {&b.shared_w1, act_.gu, 2 * inter, LinearId::kSharedW1},
               {&b.shared_w3, act_.gu + inter, 2 * inter, LinearId::kSharedW3}, -1);
       }
     });
  // SwiGLU with w2's activation quantisation fused in.
  const bool fuse_a = !limits_.exact_linears && inter % 128 == 0;
  op(op_event(OpKind::kSwiglu, block, 0,
              {bf16_ref(act_.gu, T, 2 * inter, 2 * inter), bf16_ref(act_.sact, T, inter)}),
     [&] {
       if (!fuse_a)
         return glue::swiglu(act_.gu, 2 * inter, T, inter, c.swiglu_limit, act_.sact, stream_);
       DSV4_CHECK(T <= act_m_max_ && inter <= act_k_max_, "shared expert of [", T, ", ", inter,
                  "] exceeds the planned activations");
       glue::SwigluFp8Params sp;
       sp.gu = act_.gu;
       sp.ld_gu = 2 * inter;
       sp.rows = T;
       sp.inter = inter;
       sp.limit = c.swiglu_limit;
       sp.out = act_.sact;
       sp.codes = act_.act_codes[1];
       sp.scales_t = act_.act_scales[1];
       sp.ld_scales = cuda::fp8_scale_ld(T);
       sp.pdl = true;
       glue::swiglu_fp8(sp, stream_);
     });
  const Fp8Act aa =
      fuse_a ? fused_act(act_.sact, inter, T, inter, 1) : quantize(act_.sact, inter, T, inter, 1);
  gemm(aa, b.shared_w2, act_.shared, c.dim, true, block, LinearId::kSharedW2);
  if (side) {
    on_side.reset();
    DSV4_CUDA_CHECK(cudaEventRecord(join_, side_));
  }
  if (pmoe_) {  // the parallel engine: routed experts across ranks
    pmoe_->forward(b, x, st.tokens, act_.shared, T, out, stream_);
    return;
  }

  const int K = c.n_activated_experts;
  const cuda::moe::MoeWorkspace ws = cuda::moe::carve_moe_workspace(b.moe, T, K, act_.moe_ws);
  op(op_event(OpKind::kMoe, block, 0,
              {bf16_ref(x, T, c.dim), bf16_ref(act_.shared, T, c.dim), i32_ref(ws.sel, T, K),
               f32_ref(ws.wt, T, K), bf16_ref(out, T, c.dim)}),
     [&] { cuda::moe::moe_forward(b.moe, m); });
}

// ---- blocks, head, entry points ----------------------------------------------------------------

// One block on act_.streams[cur_], whose attention input (hc_pre of the block) is in act_.x.
// Ends with hc_post of the MoE fused into the next block's hc_pre when `fuse_next`.
void CudaModel::block_body(int block, const DeviceStep& st, DeviceCache& cache, bool fuse_next) {
  const int T = st.num_tokens, hcd = cfg_.hc_mult * cfg_.dim, dim = cfg_.dim;
  op(op_event(OpKind::kAttnSublayer, block, 0,
              {bf16_ref(act_.x, T, dim), bf16_ref(act_.sub_out, T, dim),
               bf16_ref(act_.streams[cur_], T, hcd)}),
     [&] { attention(block, st, cache, act_.x, act_.sub_out); });
  hc_post(block, false, st, act_.sub_out, block, true);
  op(op_event(OpKind::kFfnSublayer, block, 0,
              {bf16_ref(act_.x, T, dim), bf16_ref(act_.sub_out, T, dim),
               bf16_ref(act_.streams[cur_], T, hcd)}),
     [&] { moe(block, st, act_.x, act_.sub_out); });
  hc_post(block, true, st, act_.sub_out, fuse_next ? block + 1 : -1, false);
}

void CudaModel::head(const CudaHcUnit& unit, const CudaBf16& norm, const bf16* streams, int rows,
                     const int32_t* row_ids, int mtp) {
  const int hcd = cfg_.hc_mult * cfg_.dim;
  DSV4_CHECK(rows <= limits_.max_logit_rows, rows, " logits rows exceed the planned ",
             limits_.max_logit_rows, " per step");
  const bf16* src = streams;
  if (row_ids) {
    glue::gather_rows(streams, hcd, row_ids, rows, act_.rows, stream_);
    src = act_.rows;
  }
  cuda::HcHeadParams hp;
  hp.shape = hc_shape(cfg_);
  hp.tokens = rows;
  hp.streams = src;
  hp.unit = unit.params();
  hp.norm.weight = norm.ptr();
  hp.norm.eps = cfg_.norm_eps;
  hp.y = act_.head_y;
  op(op_event(OpKind::kHcHead, mtp < 0 ? -1 : cfg_.n_layers + mtp, mtp,
              {bf16_ref(src, rows, hcd), bf16_ref(act_.head_y, rows, cfg_.dim)}),
     [&] { cuda::hc_head(hp, stream_); });
  cuda::LogitsParams lp;
  lp.x = act_.head_y;
  lp.m = rows;
  lp.w = w_.head.ptr();
  lp.vocab = cfg_.vocab_size;
  lp.dim = cfg_.dim;
  lp.logits = act_.logits;
  lp.cublas = blas_->handle();
  op(op_event(OpKind::kLogits, -1, 0,
              {bf16_ref(act_.head_y, rows, cfg_.dim), f32_ref(act_.logits, rows, cfg_.vocab_size)}),
     [&] { cuda::head_logits(lp, stream_); });
}

void CudaModel::forward(const DeviceStep& st, DeviceCache& cache) {
  const ModelConfig& c = cfg_;
  const bool timed = !events_.empty();
  // Inside a stream capture a plain cudaEventRecord only orders work and never records, so a
  // replayed graph would leave the events unset: there the record is an external event node.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (timed) DSV4_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
  auto mark = [&](cudaEvent_t e) {
    if (capture == cudaStreamCaptureStatusActive)
      DSV4_CUDA_CHECK(cudaEventRecordWithFlags(e, stream_, cudaEventRecordExternal));
    else
      DSV4_CUDA_CHECK(cudaEventRecord(e, stream_));
  };
  if (timed) mark(events_[0]);
  rope_tables(st);
  begin_step(st);
  cuda::EmbedParams ep;
  ep.tokens = st.tokens;
  ep.n = st.num_tokens;
  ep.table = w_.embed.ptr();
  ep.vocab = c.vocab_size;
  ep.dim = c.dim;
  ep.repeat = c.hc_mult;
  ep.out = act_.streams[0];
  op(op_event(OpKind::kEmbed, -1, 0, {bf16_ref(ep.out, st.num_tokens, c.hc_mult * c.dim)}),
     [&] { cuda::embed(ep, stream_); });
  cur_ = 0;
  pp_ = 0;
  hc_pre(0, false, st, act_.streams[cur_]);
  for (int b = 0; b < c.n_layers; ++b) {
    block_body(b, st, cache, b + 1 < c.n_layers);
    if (timed) mark(events_[b + 1]);
  }
  head(w_.hc_head, w_.norm, act_.streams[cur_], st.num_logit_rows, st.logit_rows, -1);
  if (timed) mark(events_[c.n_layers + 1]);
  end_step();
}

void CudaModel::mtp_forward(int j, const DeviceStep& st, const bf16* main_streams,
                            DeviceCache& cache, bool logits) {
  const ModelConfig& c = cfg_;
  DSV4_CHECK(j >= 0 && j < c.n_mtp_layers, "MTP block ", j, " does not exist");
  const int b = c.n_layers + j, T = st.num_tokens, hc = c.hc_mult;
  const CudaBlockWeights& bw = w_.blocks[b];
  rope_tables(st);
  begin_step(st);
  cuda::EmbedParams ep;
  ep.tokens = st.tokens;
  ep.n = T;
  ep.table = w_.embed.ptr();
  ep.vocab = c.vocab_size;
  ep.dim = c.dim;
  ep.repeat = 1;
  ep.out = act_.e;
  cuda::embed(ep, stream_);
  // Each norm quantises its output for its FP8 projection in the same pass (activation slots 0
  // and 1); the exact linears quantise separately.
  const bool fuse = !limits_.exact_linears && c.dim % 128 == 0;
  auto norm = [&](const bf16* x, int rows, const CudaBf16& w, bf16* y, NormId which, int slot) {
    cuda::RmsNormParams rn;
    rn.x = x;
    rn.rows = rows;
    rn.n = c.dim;
    rn.weight = w.ptr();
    rn.eps = c.norm_eps;
    rn.y = y;
    if (fuse) {
      DSV4_CHECK(rows <= act_m_max_ && c.dim <= act_k_max_, "MTP norm of [", rows, ", ", c.dim,
                 "] exceeds the planned activations");
      rn.q_codes = act_.act_codes[slot];
      if (slot == 0) x_fp8_ = false;
      rn.q_scales_t = act_.act_scales[slot];
      rn.q_ld_scales = cuda::fp8_scale_ld(rows);
    }
    op(op_event(OpKind::kRmsNorm, b, int(which),
                {bf16_ref(x, rows, c.dim), bf16_ref(y, rows, c.dim)}),
       [&] { cuda::rms_norm(rn, stream_); });
    return fuse ? fused_act(y, c.dim, rows, c.dim, slot) : Fp8Act{};
  };
  Fp8Act ae = norm(act_.e, T, bw.enorm, act_.e_n, NormId::kEnorm, 0);
  Fp8Act ah = norm(main_streams, T * hc, bw.hnorm, act_.h_n, NormId::kHnorm, 1);
  if (!fuse) ae = quantize(act_.e_n, c.dim, T, c.dim, 0);
  gemm(ae, bw.e_proj, act_.ep, c.dim, true, b, LinearId::kEProj);
  if (!fuse) ah = quantize(act_.h_n, c.dim, T * hc, c.dim, 1);
  gemm(ah, bw.h_proj, act_.hp, c.dim, true, b, LinearId::kHProj);
  op(op_event(OpKind::kMtpCombine, b, 0,
              {bf16_ref(act_.ep, T, c.dim), bf16_ref(act_.hp, T, int64_t(hc) * c.dim),
               bf16_ref(act_.streams[0], T, int64_t(hc) * c.dim)}),
     [&] { glue::mtp_combine(act_.ep, act_.hp, T, hc, c.dim, act_.streams[0], stream_); });
  cur_ = 0;
  pp_ = 0;
  hc_pre(b, false, st, act_.streams[cur_]);
  block_body(b, st, cache, false);
  // The step's logit rows, or every row when it names none.
  const bool rows = st.num_logit_rows > 0;
  if (logits)
    head(bw.mtp_hc_head, bw.mtp_norm, act_.streams[cur_], rows ? st.num_logit_rows : T,
         rows ? st.logit_rows : nullptr, j);
  end_step();
}

void CudaModel::run_block(int block, const DeviceStep& st, DeviceCache& cache, bf16* streams) {
  DSV4_CHECK(block >= 0 && block < cfg_.num_blocks(), "block ", block, " does not exist");
  const size_t bytes = size_t(st.num_tokens) * cfg_.hc_mult * cfg_.dim * 2;
  rope_tables(st);
  begin_step(st);
  cur_ = 0;
  pp_ = 0;
  DSV4_CUDA_CHECK(
      cudaMemcpyAsync(act_.streams[0], streams, bytes, cudaMemcpyDeviceToDevice, stream_));
  hc_pre(block, false, st, act_.streams[cur_]);
  block_body(block, st, cache, false);
  DSV4_CUDA_CHECK(
      cudaMemcpyAsync(streams, act_.streams[cur_], bytes, cudaMemcpyDeviceToDevice, stream_));
  end_step();
}

void CudaModel::run_attention(int block, const DeviceStep& st, DeviceCache& cache, const bf16* x,
                              bf16* out) {
  DSV4_CHECK(block >= 0 && block < cfg_.num_blocks(), "block ", block, " does not exist");
  rope_tables(st);
  begin_step(st);
  attention(block, st, cache, x, out);
  end_step();
}

void CudaModel::logits_of(const bf16* streams, int rows) {
  DSV4_CHECK(rows >= 0, "logits_of: ", rows, " rows");
  head(w_.hc_head, w_.norm, streams, rows, nullptr, -1);
}

void CudaModel::run_moe(int block, const DeviceStep& st, const bf16* x, bf16* out) {
  DSV4_CHECK(block >= 0 && block < cfg_.num_blocks(), "block ", block, " does not exist");
  DSV4_CHECK(st.num_tokens <= limits_.max_tokens, "step exceeds the plan");
  begin_step(st);
  moe(block, st, x, out);
  end_step();
}

}  // namespace dsv4
