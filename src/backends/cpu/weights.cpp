#include "backends/cpu/weights.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>

#include "core/error.h"
#include "ops/cpu/dequant.h"

namespace dsv4::cpu {
namespace {

Linear fp8_linear(const Fp8Ref& r) {
  return Linear::from_rows(LinearKind::kFp8, int(r.weight->shape[0]), int(r.weight->shape[1]),
                           dequant_fp8(r));
}

Linear fp4_linear(const Fp4Ref& r) {
  return Linear::from_rows(LinearKind::kFp4, int(r.weight->shape[0]), int(r.weight->shape[1] * 2),
                           dequant_fp4(r));
}

Linear plain_linear(LinearKind kind, const TensorView& t) {
  return Linear::from_rows(kind, int(t.shape[0]), int(t.shape[1]), to_float(t));
}

HcWeights hc(const HcRef& r) {
  return {to_float(*r.fn), to_float(*r.base), to_float(*r.scale)};
}

CompressorWeights compressor(const CompressorRef& r, int ratio, int d, bool rotate) {
  CompressorWeights c;
  c.ratio = ratio;
  c.dim = d;
  c.wkv = plain_linear(LinearKind::kF32, *r.wkv);
  c.wgate = plain_linear(LinearKind::kF32, *r.wgate);
  c.ape = to_float(*r.ape);
  c.norm = to_float(*r.norm);
  c.rotate = rotate;
  return c;
}

ExpertWeights fp8_expert(const Fp8Ref& w1, const Fp8Ref& w2, const Fp8Ref& w3) {
  return {fp8_linear(w1), fp8_linear(w2), fp8_linear(w3)};
}

}  // namespace

const Linear& block_linear(const BlockWeights& b, LinearId id) {
  switch (id) {
    case LinearId::kWqA:
      return b.attn.wq_a;
    case LinearId::kWkv:
      return b.attn.wkv;
    case LinearId::kWqB:
      return b.attn.wq_b;
    case LinearId::kWoB:
      return b.attn.wo_b;
    case LinearId::kIndexWqB:
      return b.attn.indexer->wq_b;
    case LinearId::kWeightsProj:
      return b.attn.indexer->weights_proj;
    case LinearId::kCompWkv:
      return b.attn.compressor->wkv;
    case LinearId::kCompWgate:
      return b.attn.compressor->wgate;
    case LinearId::kIndexCompWkv:
      return b.attn.indexer->compressor.wkv;
    case LinearId::kIndexCompWgate:
      return b.attn.indexer->compressor.wgate;
    case LinearId::kSharedW1:
      return b.ffn.shared.w1;
    case LinearId::kSharedW3:
      return b.ffn.shared.w3;
    case LinearId::kSharedW2:
      return b.ffn.shared.w2;
    case LinearId::kEProj:
      return b.mtp->e_proj;
    case LinearId::kHProj:
      return b.mtp->h_proj;
  }
  throw Error("block_linear: unknown linear");
}

const std::vector<float>& block_norm(const BlockWeights& b, NormId id) {
  switch (id) {
    case NormId::kQNorm:
      return b.attn.q_norm;
    case NormId::kEnorm:
      return b.mtp->enorm;
    case NormId::kHnorm:
      return b.mtp->hnorm;
  }
  throw Error("block_norm: unknown norm");
}

HcParams hc_params(const ModelConfig& c, const HcWeights& w) {
  HcParams p;
  p.hc = c.hc_mult;
  p.dim = c.dim;
  p.sinkhorn_iters = c.hc_sinkhorn_iters;
  p.norm_eps = c.norm_eps;
  p.hc_eps = c.hc_eps;
  p.fn = w.fn.data();
  p.base = w.base.data();
  p.scale = w.scale.data();
  return p;
}

namespace {

// Output rows [lo, lo + n) of a linear (its per-output sums do not depend on the others).
Linear slice_out(const Linear& w, int lo, int n) {
  DSV4_CHECK(lo >= 0 && n >= 0 && lo + n <= w.out, "weight slice [", lo, ", ", lo + n, ") of ",
             w.out, " rows");
  if (lo == 0 && n == w.out) return w;
  Linear s;
  s.kind = w.kind;
  s.out = n;
  s.in = w.in;
  s.wt.resize(size_t(w.in) * n);
  for (int k = 0; k < w.in; ++k)
    std::copy_n(w.wt.begin() + size_t(k) * w.out + lo, n, s.wt.begin() + size_t(k) * n);
  return s;
}

int resolve(int n, int all) {
  return n < 0 ? all : n;
}

}  // namespace

WeightShard shard_of(const ParallelLayout& L, int w) {
  WeightShard s;
  s.heads_lo = L.heads_lo(w);
  s.heads = L.heads_per_rank();
  s.groups_lo = L.groups_lo(w);
  s.groups = L.groups_per_rank();
  s.index_heads_lo = L.index_heads_lo(w);
  s.index_heads = L.index_heads_per_rank();
  s.experts_lo = L.experts_lo(w);
  s.experts = L.experts_per_rank();
  return s;
}

ModelWeights prepare_weights(const ModelConfig& c, const WeightsRef& ref, const WeightShard& sh) {
  const int H = resolve(sh.heads, c.n_heads), G = resolve(sh.groups, c.o_groups);
  const int HI = resolve(sh.index_heads, c.index_n_heads);
  const int E = resolve(sh.experts, c.n_routed_experts);
  DSV4_CHECK(sh.heads_lo >= 0 && sh.heads_lo + H <= c.n_heads && sh.groups_lo >= 0 &&
                 sh.groups_lo + G <= c.o_groups && sh.index_heads_lo >= 0 &&
                 sh.index_heads_lo + HI <= c.index_n_heads && sh.experts_lo >= 0 &&
                 sh.experts_lo + E <= c.n_routed_experts,
             "weight shard out of the model's ranges");
  ModelWeights m;
  m.embed = to_float(*ref.embed);
  m.head = plain_linear(LinearKind::kF32, *ref.head);
  m.norm = to_float(*ref.norm);
  m.hc_head = hc(ref.hc_head);
  for (const BlockRef& br : ref.blocks) {
    BlockWeights b;
    b.index = br.index;
    b.ratio = c.ratio(br.index);
    b.hc_attn = hc(br.hc_attn);
    b.hc_ffn = hc(br.hc_ffn);
    b.attn_norm = to_float(*br.attn_norm);
    b.ffn_norm = to_float(*br.ffn_norm);

    AttentionWeights& a = b.attn;
    a.wq_a = fp8_linear(br.attn.wq_a);
    a.wq_b = slice_out(fp8_linear(br.attn.wq_b), sh.heads_lo * c.head_dim, H * c.head_dim);
    a.wkv = fp8_linear(br.attn.wkv);
    a.wo_b = fp8_linear(br.attn.wo_b);
    // wo_a is applied in BF16 by the reference; its FP8 x UE8M0 values are exact in BF16.
    const std::vector<float> wo_a = dequant_fp8(br.attn.wo_a);
    const int in_g = c.heads_per_group() * c.head_dim;
    for (int g = sh.groups_lo; g < sh.groups_lo + G; ++g) {
      std::vector<float> rows(wo_a.begin() + size_t(g) * c.o_lora_rank * in_g,
                              wo_a.begin() + size_t(g + 1) * c.o_lora_rank * in_g);
      a.wo_a.push_back(Linear::from_rows(LinearKind::kBf16, c.o_lora_rank, in_g, rows));
    }
    a.q_norm = to_float(*br.attn.q_norm);
    a.kv_norm = to_float(*br.attn.kv_norm);
    const std::vector<float> sink = to_float(*br.attn.attn_sink);
    a.sink.assign(sink.begin() + sh.heads_lo, sink.begin() + sh.heads_lo + H);
    if (br.attn.compressor)
      a.compressor = compressor(*br.attn.compressor, b.ratio, c.head_dim, false);
    if (br.attn.indexer) {
      IndexerWeights ix;
      ix.wq_b = slice_out(fp8_linear(br.attn.indexer->wq_b), sh.index_heads_lo * c.index_head_dim,
                          HI * c.index_head_dim);
      ix.weights_proj = slice_out(plain_linear(LinearKind::kBf16, *br.attn.indexer->weights_proj),
                                  sh.index_heads_lo, HI);
      ix.compressor = compressor(br.attn.indexer->compressor, 4, c.index_head_dim, true);
      a.indexer = std::move(ix);
    }
    if (b.ratio > 0)
      a.rope = RopeTable::make(c.rope_head_dim, c.compress_rope_theta, c.original_seq_len,
                               c.rope_factor, c.beta_fast, c.beta_slow);
    else
      a.rope = RopeTable::make(c.rope_head_dim, c.rope_theta, 0, c.rope_factor, c.beta_fast,
                               c.beta_slow);

    MoeWeights& f = b.ffn;
    f.gate = plain_linear(LinearKind::kF32, *br.ffn.gate);
    if (br.ffn.bias) f.bias = to_float(*br.ffn.bias);
    if (br.ffn.tid2eid) {
      const TensorView& t = *br.ffn.tid2eid;
      f.tid2eid.resize(size_t(t.numel()));
      for (size_t i = 0; i < f.tid2eid.size(); ++i) {
        int64_t v;
        if (t.dtype == DType::kI64)
          std::memcpy(&v, t.data + 8 * i, 8);
        else {
          int32_t v32;
          std::memcpy(&v32, t.data + 4 * i, 4);
          v = v32;
        }
        DSV4_CHECK(v >= 0 && v < c.n_routed_experts, "tensor '", t.name, "': expert id ", v,
                   " out of range [0, ", c.n_routed_experts, ")");
        f.tid2eid[i] = static_cast<int32_t>(v);
      }
    }
    // Experts whose tensors are the same bytes (random weights with repeated experts) share
    // one dequantised copy (MoeWeights::slot).
    auto bytes = [](const TensorView* t) { return t ? t->data : nullptr; };
    std::map<std::array<const uint8_t*, 9>, int32_t> seen;
    std::vector<int32_t> slot;
    for (int e = 0; e < int(br.ffn.experts.size()); ++e) {
      const ExpertRef& x = br.ffn.experts[size_t(e)];
      slot.push_back(int32_t(f.experts.size()));
      if (e < sh.experts_lo || e >= sh.experts_lo + E) {
        f.experts.emplace_back();  // another rank's
        continue;
      }
      const std::array<const uint8_t*, 9> key = {
          bytes(x.w1.weight), bytes(x.w1.scale), bytes(x.w1.scale_2),
          bytes(x.w2.weight), bytes(x.w2.scale), bytes(x.w2.scale_2),
          bytes(x.w3.weight), bytes(x.w3.scale), bytes(x.w3.scale_2)};
      const auto [it, fresh] = seen.emplace(key, slot.back());
      if (!fresh) {
        slot.back() = it->second;
        continue;
      }
      f.experts.push_back({fp4_linear(x.w1), fp4_linear(x.w2), fp4_linear(x.w3)});
    }
    if (f.experts.size() < slot.size()) f.slot = std::move(slot);  // some expert is shared
    f.shared = fp8_expert(br.ffn.shared_w1, br.ffn.shared_w2, br.ffn.shared_w3);

    if (br.mtp) {
      MtpWeights t;
      t.e_proj = fp8_linear(br.mtp->e_proj);
      t.h_proj = fp8_linear(br.mtp->h_proj);
      t.enorm = to_float(*br.mtp->enorm);
      t.hnorm = to_float(*br.mtp->hnorm);
      t.norm = to_float(*br.mtp->norm);
      t.hc_head = hc(br.mtp->hc_head);
      b.mtp = std::move(t);
    }
    m.blocks.push_back(std::move(b));
  }
  return m;
}

int64_t weight_bytes(const ModelWeights& m) {
  int64_t n = 0;
  auto v = [&](const auto& vec) { n += int64_t(vec.size() * sizeof(vec[0])); };
  auto lin = [&](const Linear& l) { v(l.wt); };
  auto hcw = [&](const HcWeights& h) { v(h.fn), v(h.base), v(h.scale); };
  auto comp = [&](const CompressorWeights& c) { lin(c.wkv), lin(c.wgate), v(c.ape), v(c.norm); };
  auto expert = [&](const ExpertWeights& e) { lin(e.w1), lin(e.w2), lin(e.w3); };
  v(m.embed), lin(m.head), v(m.norm), hcw(m.hc_head);
  for (const BlockWeights& b : m.blocks) {
    hcw(b.hc_attn), hcw(b.hc_ffn), v(b.attn_norm), v(b.ffn_norm);
    const AttentionWeights& a = b.attn;
    lin(a.wq_a), lin(a.wq_b), lin(a.wkv), lin(a.wo_b);
    for (const Linear& l : a.wo_a) lin(l);
    v(a.q_norm), v(a.kv_norm), v(a.sink);
    if (a.compressor) comp(*a.compressor);
    if (a.indexer) lin(a.indexer->wq_b), lin(a.indexer->weights_proj), comp(a.indexer->compressor);
    lin(b.ffn.gate), v(b.ffn.bias), v(b.ffn.tid2eid), expert(b.ffn.shared);
    for (const ExpertWeights& e : b.ffn.experts) expert(e);
    if (b.mtp) {
      lin(b.mtp->e_proj), lin(b.mtp->h_proj), v(b.mtp->enorm), v(b.mtp->hnorm), v(b.mtp->norm);
      hcw(b.mtp->hc_head);
    }
  }
  return n;
}

}  // namespace dsv4::cpu
