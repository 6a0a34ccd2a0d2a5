#include "model/weights.h"

#include <set>
#include <sstream>

#include "core/error.h"

namespace dsv4 {

std::string block_prefix(const ModelConfig& c, int block) {
  if (block < c.n_layers) return cat("layers.", block, ".");
  return cat("mtp.", block - c.n_layers, ".");
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Looks tensors up by expected name, dtype and shape and records every deviation. Without a
// checkpoint it only lists what it would look up (weight_inventory).
class Binder {
 public:
  explicit Binder(const Checkpoint* ckpt, std::vector<ExpectedTensor>* inventory = nullptr)
      : ckpt_(ckpt), inventory_(inventory) {}

  const TensorView* get(const std::string& name, std::initializer_list<DType> dtypes,
                        std::vector<int64_t> shape) {
    if (!ckpt_) {
      inventory_->push_back({name, *dtypes.begin(), std::move(shape)});
      return nullptr;
    }
    const Checkpoint& ckpt = *ckpt_;
    expected_.insert(name);
    if (!ckpt.contains(name)) {
      missing_.push_back(cat(name, " ", dtype_name(*dtypes.begin()), " ", shape_str(shape)));
      return nullptr;
    }
    const TensorView& t = ckpt.get(name);
    bool dtype_ok = false;
    for (DType d : dtypes) dtype_ok |= (t.dtype == d);
    if (!dtype_ok || t.shape != shape) {
      std::string want;
      for (DType d : dtypes) want += (want.empty() ? "" : "|") + std::string(dtype_name(d));
      wrong_.push_back(cat(name, ": ", dtype_name(t.dtype), " ", shape_str(t.shape), ", expected ",
                           want, " ", shape_str(shape)));
      return nullptr;
    }
    return &t;
  }

  Fp8Ref fp8(const std::string& name, int64_t out, int64_t in) {
    return {get(name + ".weight", {DType::kF8E4M3}, {out, in}),
            get(name + ".scale", {DType::kF8E8M0}, {ceil_div(out, 128), ceil_div(in, 128)})};
  }

  Fp4Ref fp4(const std::string& name, int64_t out, int64_t in, ExpertFormat f) {
    Fp4Ref r;
    r.format = f;
    if (f == ExpertFormat::kMxfp4) {
      r.weight = get(name + ".weight", {DType::kI8, DType::kU8}, {out, in / 2});
      r.scale = get(name + ".scale", {DType::kF8E8M0}, {out, in / 32});
    } else {
      r.weight = get(name + ".weight", {DType::kU8, DType::kI8}, {out, in / 2});
      r.scale = get(name + ".weight_scale", {DType::kF8E4M3}, {out, in / 16});
      r.scale_2 = get(name + ".weight_scale_2", {DType::kF32}, {});
      r.input_scale = get(name + ".input_scale", {DType::kF32}, {});
    }
    return r;
  }

  HcRef hc(const std::string& prefix, int64_t mix, int64_t width, int64_t nscale) {
    return {get(prefix + "_fn", {DType::kF32}, {mix, width}),
            get(prefix + "_base", {DType::kF32}, {mix}),
            get(prefix + "_scale", {DType::kF32}, {nscale})};
  }

  CompressorRef compressor(const std::string& p, int64_t ratio, int64_t d, int64_t dim) {
    int64_t coff = ratio == 4 ? 2 : 1;
    return {get(p + "wkv.weight", {DType::kBF16}, {coff * d, dim}),
            get(p + "wgate.weight", {DType::kBF16}, {coff * d, dim}),
            get(p + "ape", {DType::kF32}, {ratio, coff * d}),
            get(p + "norm.weight", {DType::kBF16}, {d})};
  }

  // Throws when anything deviated.
  void finish() {
    if (!ckpt_) return;
    std::vector<std::string> extra;
    for (const auto& n : ckpt_->names())
      if (!expected_.count(n)) extra.push_back(n);
    if (missing_.empty() && wrong_.empty() && extra.empty()) return;
    std::ostringstream os;
    os << ckpt_->dir() << ": checkpoint does not match config.json:";
    auto list = [&](const char* what, const std::vector<std::string>& v) {
      if (v.empty()) return;
      os << " " << v.size() << " " << what << " [";
      for (size_t i = 0; i < v.size() && i < 12; ++i) os << (i ? "; " : "") << v[i];
      if (v.size() > 12) os << "; ... " << v.size() - 12 << " more";
      os << "]";
    };
    list("missing", missing_);
    list("mis-shaped/mis-typed", wrong_);
    list("unexpected", extra);
    throw Error(os.str());
  }

 private:
  const Checkpoint* ckpt_;
  std::vector<ExpectedTensor>* inventory_;
  std::set<std::string> expected_;
  std::vector<std::string> missing_, wrong_;
};

}  // namespace

namespace {

// The one walk over the model's tensors, for binding and for the inventory alike.
WeightsRef bind(Binder& b, const ModelConfig& c, const QuantScheme& scheme) {
  WeightsRef w;
  const int64_t dim = c.dim, hc_dim = int64_t(c.hc_mult) * c.dim;
  w.embed = b.get("embed.weight", {DType::kBF16}, {c.vocab_size, dim});
  w.head = b.get("head.weight", {DType::kBF16}, {c.vocab_size, dim});
  w.norm = b.get("norm.weight", {DType::kBF16}, {dim});
  w.hc_head = b.hc("hc_head", c.hc_mult, hc_dim, 1);

  for (int i = 0; i < c.num_blocks(); ++i) {
    const std::string p = block_prefix(c, i);
    const int ratio = c.ratio(i);
    BlockRef blk;
    blk.index = i;
    blk.hc_attn = b.hc(p + "hc_attn", c.mix_hc(), hc_dim, 3);
    blk.hc_ffn = b.hc(p + "hc_ffn", c.mix_hc(), hc_dim, 3);
    blk.attn_norm = b.get(p + "attn_norm.weight", {DType::kBF16}, {dim});
    blk.ffn_norm = b.get(p + "ffn_norm.weight", {DType::kBF16}, {dim});

    AttentionRef& a = blk.attn;
    const int64_t hd = c.head_dim, H = c.n_heads;
    a.wq_a = b.fp8(p + "attn.wq_a", c.q_lora_rank, dim);
    a.q_norm = b.get(p + "attn.q_norm.weight", {DType::kBF16}, {c.q_lora_rank});
    a.wq_b = b.fp8(p + "attn.wq_b", H * hd, c.q_lora_rank);
    a.wkv = b.fp8(p + "attn.wkv", hd, dim);
    a.kv_norm = b.get(p + "attn.kv_norm.weight", {DType::kBF16}, {hd});
    a.wo_a = b.fp8(p + "attn.wo_a", int64_t(c.o_groups) * c.o_lora_rank, H * hd / c.o_groups);
    a.wo_b = b.fp8(p + "attn.wo_b", dim, int64_t(c.o_groups) * c.o_lora_rank);
    a.attn_sink = b.get(p + "attn.attn_sink", {DType::kF32}, {H});
    if (ratio > 0) a.compressor = b.compressor(p + "attn.compressor.", ratio, hd, dim);
    if (ratio == 4) {
      IndexerRef ix;
      ix.wq_b = b.fp8(p + "attn.indexer.wq_b", int64_t(c.index_n_heads) * c.index_head_dim,
                      c.q_lora_rank);
      ix.weights_proj =
          b.get(p + "attn.indexer.weights_proj.weight", {DType::kBF16}, {c.index_n_heads, dim});
      ix.compressor = b.compressor(p + "attn.indexer.compressor.", 4, c.index_head_dim, dim);
      a.indexer = ix;
    }

    MoeRef& m = blk.ffn;
    const int64_t E = c.n_routed_experts, inter = c.moe_inter_dim;
    m.gate = b.get(p + "ffn.gate.weight", {DType::kBF16}, {E, dim});
    if (c.is_hash_layer(i))
      m.tid2eid = b.get(p + "ffn.gate.tid2eid", {DType::kI64, DType::kI32},
                        {c.vocab_size, c.n_activated_experts});
    else
      m.bias = b.get(p + "ffn.gate.bias", {DType::kF32}, {E});
    for (int e = 0; e < E; ++e) {
      const std::string ep = cat(p, "ffn.experts.", e, ".");
      auto fmt = [&](const char* proj) { return scheme.expert_format(ep + proj); };
      ExpertRef x;
      x.w1 = b.fp4(ep + "w1", inter, dim, fmt("w1"));
      x.w2 = b.fp4(ep + "w2", dim, inter, fmt("w2"));
      x.w3 = b.fp4(ep + "w3", inter, dim, fmt("w3"));
      m.experts.push_back(x);
    }
    m.shared_w1 = b.fp8(p + "ffn.shared_experts.w1", inter, dim);
    m.shared_w2 = b.fp8(p + "ffn.shared_experts.w2", dim, inter);
    m.shared_w3 = b.fp8(p + "ffn.shared_experts.w3", inter, dim);

    if (i >= c.n_layers) {
      MtpRef t;
      t.e_proj = b.fp8(p + "e_proj", dim, dim);
      t.h_proj = b.fp8(p + "h_proj", dim, dim);
      t.enorm = b.get(p + "enorm.weight", {DType::kBF16}, {dim});
      t.hnorm = b.get(p + "hnorm.weight", {DType::kBF16}, {dim});
      t.norm = b.get(p + "norm.weight", {DType::kBF16}, {dim});
      t.hc_head = b.hc(p + "hc_head", c.hc_mult, hc_dim, 1);
      blk.mtp = t;
    }
    w.blocks.push_back(std::move(blk));
  }
  b.finish();
  return w;
}

}  // namespace

WeightsRef bind_weights(const Checkpoint& ckpt, const ModelConfig& c, const QuantScheme& scheme) {
  Binder b(&ckpt);
  return bind(b, c, scheme);
}

std::vector<ExpectedTensor> weight_inventory(const ModelConfig& c, const QuantScheme& scheme) {
  std::vector<ExpectedTensor> v;
  Binder b(nullptr, &v);
  bind(b, c, scheme);
  return v;
}

}  // namespace dsv4
