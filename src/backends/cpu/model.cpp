#include "backends/cpu/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "backends/cpu/parallel_moe.h"
#include "core/error.h"
#include "core/formats.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/cache_codec.h"
#include "ops/cpu/compressor.h"
#include "ops/cpu/hadamard.h"
#include "ops/cpu/indexer.h"
#include "ops/cpu/mhc.h"
#include "ops/cpu/norm.h"
#include "ops/cpu/quant.h"

namespace dsv4 {

using namespace cpu;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Rotation angles of one position, for a table.
struct Angles {
  std::vector<float> cos, sin;
  Angles(const RopeTable& t, int64_t pos) : cos(t.rope_dim / 2), sin(t.rope_dim / 2) {
    t.cos_sin(pos, cos.data(), sin.data());
  }
};

// Runs the compressor of one chunk: per token, store its rows; at each block end pool,
// post-process and hand the entry (BF16 values, d wide) to `emit(entry_index, values)`.
template <typename Emit>
void run_compressor(const CompressorWeights& w, const CompressorStateLayout& layout, float* state,
                    const RopeTable& rope, float eps, const float* x, int dim, const ChunkRef& ch,
                    Emit emit) {
  const int n = ch.n, width = layout.width();
  std::vector<float> a(size_t(n) * width), g(size_t(n) * width);
  linear(w.wkv, x, n, a.data());
  linear(w.wgate, x, n, g.data());
  (void)dim;
  std::vector<float> pooled(w.dim), entry(w.dim);
  for (int t = 0; t < n; ++t) {
    const int64_t p = ch.start + t;
    compressor_store(w, layout, state, p, a.data() + size_t(t) * width,
                     g.data() + size_t(t) * width);
    if ((p + 1) % w.ratio != 0) continue;
    compressor_pool(w, layout, state, pooled.data());
    compressor_finish(w, rope, eps, p + 1 - w.ratio, pooled.data(), entry.data());
    emit((p + 1) / w.ratio - 1, entry.data());
  }
}

}  // namespace

CpuModel::CpuModel(const ModelConfig& config, ModelWeights weights)
    : cfg_(config), w_(std::move(weights)) {
  cfg_.validate();
  DSV4_CHECK(int(w_.blocks.size()) == cfg_.num_blocks(), "weights hold ", w_.blocks.size(),
             " blocks, config ", cfg_.num_blocks());
}

void CpuModel::embed(const int32_t* tokens, int n, float* streams) const {
  const int dim = cfg_.dim, hc = cfg_.hc_mult;
  for (int t = 0; t < n; ++t) {
    DSV4_CHECK(tokens[t] >= 0 && tokens[t] < cfg_.vocab_size, "token id ", tokens[t],
               " out of range [0, ", cfg_.vocab_size, ")");
    const float* e = w_.embed.data() + size_t(tokens[t]) * dim;
    for (int k = 0; k < hc; ++k) std::copy(e, e + dim, streams + (size_t(t) * hc + k) * dim);
  }
}

void CpuModel::attention(const BlockWeights& bw, const ChunkRef& ch, int chunk_index,
                         const float* x, float* out, HostCache& cache, OpObserver* obs) const {
  const ModelConfig& c = cfg_;
  const AttentionWeights& a = bw.attn;
  // Heads and output groups this rank holds (all of them on one rank; a tensor-parallel rank
  // holds a contiguous share, its weights sliced to it).
  const int b = bw.index, n = ch.n, H = int(a.sink.size()), D = c.head_dim, R = c.rope_head_dim;
  const int NOPE = D - R, W = c.window_size, ratio = bw.ratio;
  const int64_t P0 = ch.start;
  SequenceCache& seq = *ch.cache;
  const KvEntryLayout& kvl = cache.kv_layout();

  std::vector<Angles> ang;
  ang.reserve(n);
  for (int t = 0; t < n; ++t) ang.emplace_back(a.rope, P0 + t);

  // Query: q_norm(wq_a x) -> wq_b -> per-head RMS (BF16 arithmetic) -> RoPE.
  std::vector<float> qr(size_t(n) * c.q_lora_rank), q(size_t(n) * H * D);
  linear(a.wq_a, x, n, qr.data());
  rms_norm(qr.data(), n, c.q_lora_rank, a.q_norm.data(), c.norm_eps, qr.data());
  linear(a.wq_b, qr.data(), n, q.data());
  rms_norm_bf16_weightless(q.data(), n * H, D, c.norm_eps);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h)
      rope_apply(q.data() + (size_t(t) * H + h) * D + NOPE, R, ang[t].cos.data(), ang[t].sin.data(),
                 false);

  // Window KV of the chunk: kv_norm(wkv x) -> RoPE -> FP8 entry. Attention reads the decoded
  // entry, i.e. exactly what the cache holds.
  std::vector<float> kv(size_t(n) * D), kvq(size_t(n) * D);
  linear(a.wkv, x, n, kv.data());
  rms_norm(kv.data(), n, D, a.kv_norm.data(), c.norm_eps, kv.data());
  std::vector<uint8_t> staged(size_t(n) * kvl.entry_bytes());
  for (int t = 0; t < n; ++t) {
    float* row = kv.data() + size_t(t) * D;
    rope_apply(row + NOPE, R, ang[t].cos.data(), ang[t].sin.data(), false);
    uint8_t* e = staged.data() + size_t(t) * kvl.entry_bytes();
    encode_kv_entry(kvl, row, e, e + kvl.data_bytes());
    decode_kv_entry(kvl, e, e + kvl.data_bytes(), kvq.data() + size_t(t) * D);
  }

  // Compressors write their completed blocks into the cache before attention, so a query
  // sees a block that completes at its own position.
  if (a.compressor) {
    float* st = cache.main_state(b, seq.state_slot);
    run_compressor(*a.compressor, cache.main_state_layout(b), st, a.rope, c.norm_eps, x, c.dim, ch,
                   [&](int64_t i, const float* entry) {
                     EntryRef r = cache.compressed(b, seq, i);
                     encode_kv_entry(kvl, entry, r.data, r.scales);
                   });
  }
  std::vector<std::vector<int32_t>> selected(n);
  if (a.indexer) {
    const IndexerWeights& ix = *a.indexer;
    const IndexKeyLayout& il = cache.index_layout();
    float* st = cache.index_state(b, seq.state_slot);
    run_compressor(ix.compressor, cache.index_state_layout(), st, a.rope, c.norm_eps, x, c.dim, ch,
                   [&](int64_t i, const float* entry) {
                     EntryRef r = cache.index_key(b, seq, i);
                     encode_index_key(il, entry, r.data, r.scales);
                   });
    const int HI = c.index_n_heads, DI = c.index_head_dim, HIl = ix.weights_proj.out;
    std::vector<float> qi(size_t(n) * HIl * DI), wi(size_t(n) * HIl);
    linear(ix.wq_b, qr.data(), n, qi.data());
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < HIl; ++h) {
        float* v = qi.data() + (size_t(t) * HIl + h) * DI;
        rope_apply(v + DI - R, R, ang[t].cos.data(), ang[t].sin.data(), false);
        hadamard_rotate(v, DI);
        fake_quant_fp4(v, DI, IndexKeyLayout::kQuantBlock, v);
      }
    linear(ix.weights_proj, x, n, wi.data());
    const float wscale = static_cast<float>(1.0 / std::sqrt(double(DI)) / std::sqrt(double(HI)));
    for (float& v : wi) v = round_bf16(v * wscale);
    // Tensor parallel: every rank scores with all heads, gathered in head order (the scores'
    // sums over heads stay the one-rank sums).
    if (HIl != HI) {
      qi = gather_heads(qi, n, HIl * DI);
      wi = gather_heads(wi, n, HIl);
    }
    const int64_t nkeys = (P0 + n) / 4;
    std::vector<float> keys(size_t(nkeys) * DI);
    for (int64_t i = 0; i < nkeys; ++i) {
      EntryRef r = cache.index_key(b, seq, i);
      decode_index_key(il, r.data, r.scales, keys.data() + size_t(i) * DI);
    }
    std::vector<float> scores(nkeys), trace_scores;
    std::vector<int32_t> trace_sel;
    if (obs) {
      trace_scores.assign(size_t(n) * nkeys, kNegInf);
      trace_sel.assign(size_t(n) * c.index_topk, -1);
    }
    for (int t = 0; t < n; ++t) {
      const int nvis = static_cast<int>((P0 + t + 1) / 4);
      indexer_scores(qi.data() + size_t(t) * HI * DI, wi.data() + size_t(t) * HI, HI, DI,
                     keys.data(), nvis, scores.data());
      selected[t].resize(std::min(c.index_topk, nvis));
      topk_desc(scores.data(), nvis, c.index_topk, selected[t].data());
      if (obs) {
        std::copy(scores.begin(), scores.begin() + nvis, trace_scores.begin() + size_t(t) * nkeys);
        std::vector<int32_t> s = selected[t];
        std::sort(s.begin(), s.end());
        std::copy(s.begin(), s.end(), trace_sel.begin() + size_t(t) * c.index_topk);
      }
    }
    if (obs) {
      OpEvent e = op_event(OpKind::kIndexer, b, 0, {});
      e.chunk = chunk_index;
      e.t[5] = i32_ref(trace_sel.data(), n, c.index_topk);
      e.t[6] = f32_ref(trace_scores.data(), n, nkeys);
      obs->after(e);
    }
  }

  // Keys before the chunk come from the cache: the ring for the window, the compressed store.
  const int64_t ring_lo = std::max<int64_t>(0, P0 - W + 1);
  std::vector<float> ring(size_t(P0 - ring_lo) * D);
  for (int64_t j = ring_lo; j < P0; ++j) {
    EntryRef r = cache.window_slot(b, seq, j);
    decode_kv_entry(kvl, r.data, r.scales, ring.data() + size_t(j - ring_lo) * D);
  }
  const int64_t ncomp = ratio > 0 ? (P0 + n) / ratio : 0;
  std::vector<float> comp(size_t(ncomp) * D);
  std::vector<char> decoded(ncomp, 0);
  auto comp_key = [&](int64_t i) {
    if (!decoded[i]) {
      EntryRef r = cache.compressed(b, seq, i);
      decode_kv_entry(kvl, r.data, r.scales, comp.data() + size_t(i) * D);
      decoded[i] = 1;
    }
    return comp.data() + size_t(i) * D;
  };

  SparseAttnParams sp;
  sp.n_heads = H;
  sp.head_dim = D;
  sp.softmax_scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  sp.sink = a.sink.data();
  std::vector<float> o(size_t(n) * H * D);
  std::vector<const float*> keys;
  for (int t = 0; t < n; ++t) {
    const int64_t p = P0 + t;
    keys.assign(W, nullptr);
    const int64_t lo = std::max<int64_t>(0, p - W + 1);
    for (int64_t j = lo; j <= p; ++j)
      keys[j - lo] =
          j >= P0 ? kvq.data() + size_t(j - P0) * D : ring.data() + size_t(j - ring_lo) * D;
    if (ratio == 128) {
      for (int64_t i = 0; i < (p + 1) / ratio; ++i) keys.push_back(comp_key(i));
    } else if (ratio == 4) {
      for (int32_t i : selected[t]) keys.push_back(comp_key(i));
    }
    float* ot = o.data() + size_t(t) * H * D;
    sparse_attention(sp, q.data() + size_t(t) * H * D, keys.data(), int(keys.size()), ot);
    for (int h = 0; h < H; ++h)
      rope_apply(ot + size_t(h) * D + NOPE, R, ang[t].cos.data(), ang[t].sin.data(), true);
  }

  // Grouped low-rank output: heads of group g (concatenated) -> wo_a[g] (BF16) -> wo_b (FP8).
  const int G = int(a.wo_a.size()), in_g = c.heads_per_group() * D, OL = c.o_lora_rank;
  std::vector<float> z(size_t(n) * G * OL), zg(size_t(n) * OL), og(size_t(n) * in_g);
  for (int g = 0; g < G; ++g) {
    for (int t = 0; t < n; ++t)
      std::copy_n(o.data() + size_t(t) * H * D + size_t(g) * in_g, in_g,
                  og.data() + size_t(t) * in_g);
    linear(a.wo_a[g], og.data(), n, zg.data());
    for (int t = 0; t < n; ++t)
      std::copy_n(zg.data() + size_t(t) * OL, OL, z.data() + size_t(t) * G * OL + size_t(g) * OL);
  }
  // Tensor parallel: wo_b runs whole on the gathered groups, so its sums are the one-rank sums.
  if (G != c.o_groups) z = gather_heads(z, n, G * OL);
  linear(a.wo_b, z.data(), n, out);

  // The chunk's window entries go into the ring last: earlier queries of the chunk needed the
  // ring's older entries.
  for (int t = 0; t < n; ++t) {
    EntryRef r = cache.window_slot(b, seq, P0 + t);
    const uint8_t* e = staged.data() + size_t(t) * kvl.entry_bytes();
    std::memcpy(r.data, e, kvl.data_bytes());
    std::memcpy(r.scales, e + kvl.data_bytes(), kvl.scale_bytes());
  }
}

std::vector<float> CpuModel::gather_heads(const std::vector<float>& mine, int rows,
                                          int width) const {
  DSV4_CHECK(rank_ && rank_->tp, "heads are split but the model has no tensor-parallel group");
  Communicator& tp = *rank_->tp;
  std::vector<float> all(size_t(tp.size()) * rows * width);
  tp.all_gather(mine.data(), mine.size() * sizeof(float), all.data());
  // [rank][row][width] -> [row][rank][width]
  std::vector<float> out(all.size());
  for (int r = 0; r < tp.size(); ++r)
    for (int t = 0; t < rows; ++t)
      std::copy_n(all.data() + (size_t(r) * rows + t) * width, width,
                  out.data() + (size_t(t) * tp.size() + r) * width);
  return out;
}

std::unique_ptr<TraceObserver> CpuModel::tracer(TraceSink* trace) const {
  if (!trace) return nullptr;
  return std::make_unique<TraceObserver>(
      *trace, [](void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); },
      cfg_.hc_mult, cfg_.dim);
}

void CpuModel::run_block(int b, const std::vector<ChunkRef>& chunks, float* streams,
                         HostCache& cache, TraceSink* trace) const {
  block(b, chunks, streams, cache, tracer(trace).get());
}

void CpuModel::block(int block, const std::vector<ChunkRef>& chunks, float* streams,
                     HostCache& cache, OpObserver* obs) const {
  const ModelConfig& c = cfg_;
  const BlockWeights& bw = w_.blocks.at(block);
  const int hc = c.hc_mult, dim = c.dim;
  int rows = 0;
  for (const auto& ch : chunks) rows += ch.n;
  std::vector<float> x(size_t(rows) * dim), y(size_t(rows) * dim), post(size_t(rows) * hc),
      comb(size_t(rows) * hc * hc), res(size_t(hc) * dim);
  const HcParams pa = hc_params(c, bw.hc_attn), pf = hc_params(c, bw.hc_ffn);

  auto sublayer_in = [&](const HcParams& p, const std::vector<float>& norm_w) {
    for (int t = 0; t < rows; ++t)
      hc_pre(p, streams + size_t(t) * hc * dim, y.data() + size_t(t) * dim,
             post.data() + size_t(t) * hc, comb.data() + size_t(t) * hc * hc);
    rms_norm(y.data(), rows, dim, norm_w.data(), c.norm_eps, x.data());
  };
  auto sublayer_out = [&](const float* out) {
    for (int t = 0; t < rows; ++t) {
      float* s = streams + size_t(t) * hc * dim;
      std::copy(s, s + size_t(hc) * dim, res.begin());
      hc_post(hc, dim, out + size_t(t) * dim, res.data(), post.data() + size_t(t) * hc,
              comb.data() + size_t(t) * hc * hc, s);
    }
  };
  // The sub-layer's input, output and the block's streams, reported after the sub-layer.
  auto sublayer = [&](OpKind kind) {
    if (obs)
      obs->after(op_event(kind, block, 0,
                          {f32_ref(x.data(), rows, dim), f32_ref(y.data(), rows, dim),
                           f32_ref(streams, rows, int64_t(hc) * dim)}));
  };
  if (obs) {
    OpEvent e{OpKind::kStepBegin};
    e.chunks = &chunks;
    e.tokens = rows;
    obs->after(e);
  }

  sublayer_in(pa, bw.attn_norm);
  attention_chunks(block, chunks, x.data(), y.data(), cache, obs);
  sublayer(OpKind::kAttnSublayer);
  sublayer_out(y.data());

  sublayer_in(pf, bw.ffn_norm);
  std::vector<int32_t> tokens;
  for (const auto& ch : chunks) tokens.insert(tokens.end(), ch.tokens, ch.tokens + ch.n);
  const int k = c.n_activated_experts;
  std::vector<int32_t> rexp(size_t(rows) * k);
  std::vector<float> rw(size_t(rows) * k);
  run_moe(block, tokens.data(), rows, x.data(), y.data(), rexp.data(), rw.data());
  if (obs)
    obs->after(op_event(OpKind::kMoe, block, 0,
                        {f32_ref(x.data(), rows, dim),
                         {},
                         i32_ref(rexp.data(), rows, k),
                         f32_ref(rw.data(), rows, k),
                         f32_ref(y.data(), rows, dim)}));
  sublayer(OpKind::kFfnSublayer);
  sublayer_out(y.data());
  if (obs)
    obs->after(op_event(
        OpKind::kHcPost, block, 1,
        {f32_ref(y.data(), rows, dim), {}, {}, {}, f32_ref(streams, rows, int64_t(hc) * dim)}));
}

void CpuModel::run_attention(int block, const std::vector<ChunkRef>& chunks, const float* x,
                             float* out, HostCache& cache, TraceSink* trace) const {
  attention_chunks(block, chunks, x, out, cache, tracer(trace).get());
}

void CpuModel::attention_chunks(int block, const std::vector<ChunkRef>& chunks, const float* x,
                                float* out, HostCache& cache, OpObserver* obs) const {
  const BlockWeights& bw = w_.blocks.at(block);
  int off = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    attention(bw, chunks[i], int(i), x + size_t(off) * cfg_.dim, out + size_t(off) * cfg_.dim,
              cache, obs);
    off += chunks[i].n;
  }
}

void CpuModel::run_moe(int block, const int32_t* tokens, int rows, const float* x, float* out,
                       int32_t* route_experts, float* route_weights) const {
  MoeParams mp;
  mp.top_k = cfg_.n_activated_experts;
  mp.score_func = cfg_.score_func;
  mp.route_scale = cfg_.route_scale;
  mp.swiglu_limit = cfg_.swiglu_limit;
  if (rank_ && (rank_->ep->size() > 1 || rank_->group->size() > 1))
    moe_forward_parallel(w_.blocks.at(block).ffn, mp, x, tokens, rows, cfg_.dim, out, *rank_,
                         route_experts, route_weights);
  else
    moe_forward(w_.blocks.at(block).ffn, mp, x, tokens, rows, cfg_.dim, out, route_experts,
                route_weights);
}

void CpuModel::head_logits(const HcWeights& hcw, const std::vector<float>& norm,
                           const float* streams, int n, float* out) const {
  const HcParams p = hc_params(cfg_, hcw);
  std::vector<float> y(size_t(n) * cfg_.dim);
  for (int t = 0; t < n; ++t)
    hc_head(p, streams + size_t(t) * cfg_.hc_mult * cfg_.dim, y.data() + size_t(t) * cfg_.dim);
  rms_norm(y.data(), n, cfg_.dim, norm.data(), cfg_.norm_eps, y.data());
  linear(w_.head, y.data(), n, out);
}

void CpuModel::logits(const float* streams, int n, float* out) const {
  head_logits(w_.hc_head, w_.norm, streams, n, out);
}

std::vector<float> CpuModel::forward(const std::vector<ChunkRef>& chunks, HostCache& cache,
                                     const std::vector<int>& rows, TraceSink* trace,
                                     std::vector<float>* hidden_out,
                                     std::vector<int>* first_nonfinite) const {
  const int hc = cfg_.hc_mult, dim = cfg_.dim;
  int total = 0;
  for (const auto& ch : chunks) total += ch.n;
  std::vector<float> streams(size_t(total) * hc * dim);
  int off = 0;
  for (const auto& ch : chunks) {
    embed(ch.tokens, ch.n, streams.data() + size_t(off) * hc * dim);
    off += ch.n;
  }
  if (first_nonfinite) first_nonfinite->assign(size_t(total), -1);
  const std::unique_ptr<TraceObserver> obs = tracer(trace);
  for (int b = 0; b < cfg_.n_layers; ++b) {
    block(b, chunks, streams.data(), cache, obs.get());
    if (!first_nonfinite) continue;
    for (int r = 0; r < total; ++r) {
      int& bad = (*first_nonfinite)[size_t(r)];
      if (bad >= 0) continue;
      const float* s = streams.data() + size_t(r) * hc * dim;
      for (size_t i = 0; i < size_t(hc) * dim; ++i)
        if (!std::isfinite(s[i])) {
          bad = b;
          break;
        }
    }
  }
  std::vector<float> picked(rows.size() * size_t(hc) * dim);
  for (size_t i = 0; i < rows.size(); ++i) {
    DSV4_CHECK(rows[i] >= 0 && rows[i] < total, "logit row ", rows[i], " out of range");
    std::copy_n(streams.data() + size_t(rows[i]) * hc * dim, size_t(hc) * dim,
                picked.data() + i * hc * dim);
  }
  std::vector<float> out(rows.size() * size_t(cfg_.vocab_size));
  logits(picked.data(), int(rows.size()), out.data());
  if (hidden_out) *hidden_out = std::move(streams);
  return out;
}

std::vector<float> CpuModel::mtp_forward(int j, const std::vector<ChunkRef>& chunks,
                                         const float* main_streams, HostCache& cache,
                                         TraceSink* trace, std::vector<float>* streams_out) const {
  DSV4_CHECK(j >= 0 && j < cfg_.n_mtp_layers, "MTP block ", j, " does not exist");
  const int b = cfg_.n_layers + j, hc = cfg_.hc_mult, dim = cfg_.dim;
  const BlockWeights& bw = w_.blocks.at(b);
  const MtpWeights& m = *bw.mtp;
  int n = 0;
  for (const auto& ch : chunks) n += ch.n;
  std::vector<float> e(size_t(n) * dim), h(size_t(n) * hc * dim), ep(size_t(n) * dim),
      hp(size_t(n) * hc * dim), x(size_t(n) * hc * dim);
  int off = 0;
  for (const auto& ch : chunks) {
    for (int t = 0; t < ch.n; ++t) {
      DSV4_CHECK(ch.tokens[t] >= 0 && ch.tokens[t] < cfg_.vocab_size, "token id ", ch.tokens[t],
                 " out of range");
      std::copy_n(w_.embed.data() + size_t(ch.tokens[t]) * dim, dim,
                  e.data() + size_t(off + t) * dim);
    }
    off += ch.n;
  }
  rms_norm(e.data(), n, dim, m.enorm.data(), cfg_.norm_eps, e.data());
  rms_norm(main_streams, n * hc, dim, m.hnorm.data(), cfg_.norm_eps, h.data());
  linear(m.e_proj, e.data(), n, ep.data());
  linear(m.h_proj, h.data(), n * hc, hp.data());
  for (int t = 0; t < n; ++t)
    for (int k = 0; k < hc; ++k)
      for (int d = 0; d < dim; ++d) {
        const size_t i = (size_t(t) * hc + k) * dim + d;
        x[i] = round_bf16(ep[size_t(t) * dim + d] + hp[i]);
      }
  run_block(b, chunks, x.data(), cache, trace);
  std::vector<float> out(size_t(n) * cfg_.vocab_size);
  head_logits(m.hc_head, m.norm, x.data(), n, out.data());
  if (streams_out) *streams_out = std::move(x);
  return out;
}

}  // namespace dsv4
