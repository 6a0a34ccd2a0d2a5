#include "backends/cuda/weights.h"

#include <cstdio>
#include <cstring>
#include <string>

#include "core/error.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/attn_output/attn_output.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/gemm/w8a16_linear.h"
#include "ops/cuda/moe/moe_config.h"

namespace dsv4 {
namespace {

template <typename T>
DeviceBuffer<T> upload_raw(const TensorView& t) {
  DSV4_CHECK(t.nbytes % sizeof(T) == 0, "tensor '", t.name, "': ", t.nbytes,
             " bytes is not a whole number of elements");
  DeviceBuffer<T> d(t.nbytes / sizeof(T));
  if (t.nbytes) DSV4_CUDA_CHECK(cudaMemcpy(d.data(), t.data, t.nbytes, cudaMemcpyHostToDevice));
  return d;
}

CudaBf16 bf16_tensor(const TensorView* t, const char* what) {
  DSV4_CHECK(t != nullptr, "CUDA weights: ", what, " missing");
  DSV4_CHECK(t->dtype == DType::kBF16, "tensor '", t->name, "': expected BF16, got ",
             dtype_name(t->dtype));
  return {upload_raw<uint16_t>(*t)};
}

DeviceBuffer<float> f32_tensor(const TensorView* t, const char* what) {
  DSV4_CHECK(t != nullptr, "CUDA weights: ", what, " missing");
  DSV4_CHECK(t->dtype == DType::kF32, "tensor '", t->name, "': expected F32, got ",
             dtype_name(t->dtype));
  return upload_raw<float>(*t);
}

CudaHcUnit hc_unit(const HcRef& r) {
  return {f32_tensor(r.fn, "hc fn"), f32_tensor(r.base, "hc base"),
          f32_tensor(r.scale, "hc scale")};
}

void check_fp8(const Fp8Ref& r) {
  DSV4_CHECK(r.weight && r.scale, "CUDA weights: FP8 linear missing");
  DSV4_CHECK(r.weight->dtype == DType::kF8E4M3 && r.weight->shape.size() == 2, "tensor '",
             r.weight->name, "': expected F8_E4M3 [out, in]");
  DSV4_CHECK(r.weight->shape[1] % 128 == 0, "tensor '", r.weight->name,
             "': in = ", r.weight->shape[1], " is not a multiple of 128 (FP8 GEMM)");
}

// e4m3 rows of the given linears stacked into one [sum n, k] matrix; every part but the last
// must have n % 128 == 0 so that the 128-row scale blocks stay aligned.
CudaFp8Linear fp8_stack(const std::vector<const Fp8Ref*>& parts) {
  CudaFp8Linear l;
  l.k = int(parts[0]->weight->shape[1]);
  int64_t rows = 0, scale_rows = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Fp8Ref& r = *parts[i];
    check_fp8(r);
    DSV4_CHECK(r.weight->shape[1] == l.k, "tensor '", r.weight->name, "': in differs");
    DSV4_CHECK(i + 1 == parts.size() || r.weight->shape[0] % 128 == 0, "tensor '", r.weight->name,
               "': rows not a multiple of 128 cannot be stacked");
    rows += r.weight->shape[0];
    scale_rows += r.scale->shape[0];
  }
  l.n = int(rows);
  l.codes = DeviceBuffer<uint8_t>(size_t(rows) * l.k);
  DeviceBuffer<uint8_t> e8m0(size_t(scale_rows) * (l.k / 128));
  size_t off = 0, soff = 0;
  for (const Fp8Ref* r : parts) {
    DSV4_CUDA_CHECK(cudaMemcpy(l.codes.data() + off, r->weight->data, r->weight->nbytes,
                               cudaMemcpyHostToDevice));
    DSV4_CHECK(r->scale->nbytes == size_t(r->scale->shape[0]) * (l.k / 128), "tensor '",
               r->scale->name, "': unexpected scale size");
    DSV4_CUDA_CHECK(
        cudaMemcpy(e8m0.data() + soff, r->scale->data, r->scale->nbytes, cudaMemcpyHostToDevice));
    off += r->weight->nbytes;
    soff += r->scale->nbytes;
  }
  l.scales_t = DeviceBuffer<float>(size_t(l.k / 128) * ((l.n + 127) / 128));
  cuda::fp8_weight_scales_to_f32(e8m0.data(), l.n, l.k, l.scales_t.data(), nullptr);
  // The exact W8A16 path (--exact-linears) reads the UE8M0 blocks and per-row BF16 scales
  // (1/64 of the weight bytes); both are kept so either path can run.
  if (l.n % 128 == 0) {
    l.scale_rows = DeviceBuffer<uint16_t>(cuda::w8a16_scale_rows_elems(l.n, l.k));
    cuda::w8a16_prepare_scales(e8m0.data(), l.n, l.k,
                               reinterpret_cast<__nv_bfloat16*>(l.scale_rows.data()), nullptr);
  }
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  l.scale_e8m0 = std::move(e8m0);
  return l;
}

CudaFp8Linear fp8(const Fp8Ref& r) {
  return fp8_stack({&r});
}

// BF16 rows of several [rows_i, dim] tensors stacked.
CudaBf16 bf16_stack(const std::vector<const TensorView*>& parts) {
  size_t n = 0;
  for (const TensorView* t : parts) {
    DSV4_CHECK(t && t->dtype == DType::kBF16, "CUDA weights: compressor projection must be BF16");
    n += t->nbytes / 2;
  }
  CudaBf16 out{DeviceBuffer<uint16_t>(n)};
  size_t off = 0;
  for (const TensorView* t : parts) {
    DSV4_CUDA_CHECK(cudaMemcpy(out.bits.data() + off, t->data, t->nbytes, cudaMemcpyHostToDevice));
    off += t->nbytes / 2;
  }
  return out;
}

// Rows [lo, lo + n) of a tensor's first dimension (a view into the checkpoint's bytes).
TensorView rows_of(const TensorView& t, int64_t lo, int64_t n) {
  DSV4_CHECK(!t.shape.empty() && lo >= 0 && n >= 0 && lo + n <= t.shape[0], "tensor '", t.name,
             "': rows [", lo, ", ", lo + n, ") out of range");
  const size_t row = t.nbytes / size_t(t.shape[0]);
  TensorView v = t;
  v.data = t.data + size_t(lo) * row;
  v.shape[0] = n;
  v.nbytes = size_t(n) * row;
  v.name = cat(t.name, "[", lo, ":", lo + n, "]");
  return v;
}

// An FP8 linear's output rows [lo, lo + n) with their scale blocks.
struct Fp8Rows {
  TensorView weight, scale;
  Fp8Ref ref() const { return {&weight, &scale}; }
};
Fp8Rows fp8_rows(const Fp8Ref& r, int64_t lo, int64_t n) {
  check_fp8(r);
  DSV4_CHECK(lo % 128 == 0 && (n % 128 == 0 || lo + n == r.weight->shape[0]), "tensor '",
             r.weight->name, "': rows [", lo, ", ", lo + n,
             ") of a shard do not fall on its 128-row scale blocks");
  return {rows_of(*r.weight, lo, n), rows_of(*r.scale, lo / 128, (n + 127) / 128)};
}

// The router of a layer whose routed experts are split over ranks: gate, bias and tid2eid for
// every expert, no expert weights; inter and format from the rank's share.
cuda::moe::MoeDeviceWeights router_of(const MoeRef& ref, const cuda::moe::MoeDeviceWeights& mine) {
  cuda::moe::MoeDeviceWeights w;
  const int E = int(ref.experts.size());
  w.format = mine.format;
  w.n_experts = E;
  w.dim = mine.dim;
  w.inter = mine.inter;
  DSV4_CHECK(ref.gate && ref.gate->dtype == DType::kBF16 && ref.gate->shape.size() == 2 &&
                 ref.gate->shape[0] == E,
             "moe: gate must be BF16 [", E, ", dim]");
  w.gate = upload_raw<uint16_t>(*ref.gate);
  if (ref.bias) w.bias = f32_tensor(ref.bias, "gate bias");
  if (ref.tid2eid) {
    const TensorView& t = *ref.tid2eid;
    DSV4_CHECK((t.dtype == DType::kI64 || t.dtype == DType::kI32) && t.shape.size() == 2,
               "tensor '", t.name, "': expected I64/I32 [vocab, top_k]");
    w.vocab = int(t.shape[0]);
    w.hash_top_k = int(t.shape[1]);
    std::vector<int32_t> ids(size_t(t.numel()));
    for (size_t i = 0; i < ids.size(); ++i) {
      int64_t v = 0;
      if (t.dtype == DType::kI64) {
        std::memcpy(&v, t.data + 8 * i, 8);
      } else {
        int32_t v32;
        std::memcpy(&v32, t.data + 4 * i, 4);
        v = v32;
      }
      DSV4_CHECK(v >= 0 && v < E, "tensor '", t.name, "': expert id ", v, " out of range [0, ", E,
                 ")");
      ids[i] = int32_t(v);
    }
    w.tid2eid = DeviceBuffer<int32_t>(ids);
  }
  return w;
}

size_t free_device_bytes() {
  size_t free = 0, total = 0;
  DSV4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

}  // namespace

int cuda_attention_heads(int heads) {
  DSV4_CHECK(heads >= 1 && heads <= 256, "attention heads ", heads, " per rank");
  return heads <= 4 ? 4 : heads <= 8 ? 8 : (heads + 15) / 16 * 16;
}

void check_cuda_supported(const ModelConfig& c) {
  // Every unmet requirement is named, not only the first.
  std::string unmet;
  auto need = [&](bool ok, auto&&... what) {
    if (!ok) unmet += cat(unmet.empty() ? "" : "; ", what...);
  };
  need(c.hc_mult == 4, "hc_mult ", c.hc_mult, " (the mHC kernels take 4)");
  need(c.head_dim == 512 && c.rope_head_dim == 64, "head_dim ", c.head_dim, " / rope ",
       c.rope_head_dim, " (the KV cache and attention kernels take 512 = 448 + 64)");
  need(c.dim >= 128 && c.dim % 128 == 0 && c.dim <= 8192, "dim ", c.dim,
       " (a multiple of 128 for the FP8 / FP4 GEMMs' K blocks, at most 8192)");
  need(c.q_lora_rank % 128 == 0 && c.o_lora_rank % 128 == 0 && c.moe_inter_dim % 128 == 0,
       "q_lora ", c.q_lora_rank, ", o_lora ", c.o_lora_rank, ", moe_inter ", c.moe_inter_dim,
       " (FP8 / FP4 GEMMs need multiples of 128)");
  // Other head counts run padded with zero heads to 4, 8 or a multiple of 16
  // (cuda_attention_heads); the activations are planned for the padded count.
  need(c.n_heads >= 1 && c.n_heads <= 256, "n_heads ", c.n_heads, " (1..256)");
  need(c.window_size >= 1 && c.window_size <= 4096, "window ", c.window_size);
  need(c.score_func == ScoreFunc::kSqrtSoftplus || c.score_func == ScoreFunc::kSigmoid,
       "score function (sqrt-softplus or sigmoid on CUDA)");
  need(c.n_shared_experts == 1, "n_shared_experts ", c.n_shared_experts, " (one shared expert)");
  bool csa = false;
  for (int r : c.compress_ratios) {
    need(r == 0 || r == 4 || r == 128, "compress ratio ", r);
    csa |= r == 4;
  }
  if (csa) {
    need(c.index_head_dim == 128, "index_head_dim ", c.index_head_dim, " (128 only)");
    // Fewer than 8, 16, 32 or 64 run padded with zero heads in the indexer's logits kernel.
    need(c.index_n_heads >= 1 && c.index_n_heads <= 64, "index_n_heads ", c.index_n_heads,
         " (1..64)");
    need(c.index_topk >= 1 && c.index_topk <= 1024, "index_topk ", c.index_topk);
  }
  if (!unmet.empty()) throw Error(cat("CUDA backend: unsupported model: ", unmet));
}

CudaModelWeights upload_cuda_weights(const ModelConfig& c, const WeightsRef& ref, bool progress,
                                     const cpu::WeightShard& shard) {
  check_cuda_supported(c);
  const int heads_lo = shard.heads < 0 ? 0 : shard.heads_lo;
  const int heads = shard.heads < 0 ? c.n_heads : shard.heads;
  const int groups_lo = shard.groups < 0 ? 0 : shard.groups_lo;
  const int groups = shard.groups < 0 ? c.o_groups : shard.groups;
  const int iheads_lo = shard.index_heads < 0 ? 0 : shard.index_heads_lo;
  const int iheads = shard.index_heads < 0 ? c.index_n_heads : shard.index_heads;
  const int experts_lo = shard.experts < 0 ? 0 : shard.experts_lo;
  const int experts = shard.experts < 0 ? c.n_routed_experts : shard.experts;
  DSV4_CHECK(heads_lo >= 0 && heads >= 1 && heads_lo + heads <= c.n_heads && groups_lo >= 0 &&
                 groups >= 1 && groups_lo + groups <= c.o_groups && iheads_lo >= 0 &&
                 iheads_lo + iheads <= c.index_n_heads && experts_lo >= 0 && experts >= 1 &&
                 experts_lo + experts <= c.n_routed_experts &&
                 heads * c.o_groups == groups * c.n_heads,
             "CUDA weights: shard out of the model's ranges");
  const size_t free0 = free_device_bytes();
  CudaModelWeights m;
  const int units = int(ref.blocks.size()) + 1;
  auto report = [&](int done) {
    if (!progress) return;
    const double gb = double(free0 - free_device_bytes()) / double(1ull << 30);
    const int width = 40, filled = width * done / units;
    std::fprintf(stderr, "\rloading weights [%.*s%*s] %3d%% %6.1f GiB on the GPU", filled,
                 "########################################", width - filled, "", 100 * done / units,
                 gb);
    if (done == units) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  };
  report(0);
  m.embed = bf16_tensor(ref.embed, "embed");
  m.head = bf16_tensor(ref.head, "head");
  m.norm = bf16_tensor(ref.norm, "norm");
  m.hc_head = hc_unit(ref.hc_head);
  const cpu::RopeTable plain = cpu::RopeTable::make(c.rope_head_dim, c.rope_theta, 0, c.rope_factor,
                                                    c.beta_fast, c.beta_slow);
  const cpu::RopeTable yarn =
      cpu::RopeTable::make(c.rope_head_dim, c.compress_rope_theta, c.original_seq_len,
                           c.rope_factor, c.beta_fast, c.beta_slow);
  m.inv_freq_plain = DeviceBuffer<float>(plain.inv_freq);
  m.inv_freq_yarn = DeviceBuffer<float>(yarn.inv_freq);
  report(1);

  for (const BlockRef& br : ref.blocks) {
    CudaBlockWeights b;
    b.index = br.index;
    b.ratio = c.ratio(br.index);
    b.hc_attn = hc_unit(br.hc_attn);
    b.hc_ffn = hc_unit(br.hc_ffn);
    b.attn_norm = bf16_tensor(br.attn_norm, "attn_norm");
    b.ffn_norm = bf16_tensor(br.ffn_norm, "ffn_norm");

    const AttentionRef& a = br.attn;
    b.wq_a = fp8(a.wq_a);
    b.wq_b =
        fp8(fp8_rows(a.wq_b, int64_t(heads_lo) * c.head_dim, int64_t(heads) * c.head_dim).ref());
    b.wkv = fp8(a.wkv);
    b.wo_b = fp8(a.wo_b);
    b.q_norm = bf16_tensor(a.q_norm, "q_norm");
    b.kv_norm = bf16_tensor(a.kv_norm, "kv_norm");
    DSV4_CHECK(
        a.attn_sink && a.attn_sink->dtype == DType::kF32 && a.attn_sink->numel() == c.n_heads,
        "CUDA weights: attn_sink must be F32 [", c.n_heads, "]");
    b.heads = heads;
    b.attn_heads = cuda_attention_heads(heads);  // CudaModel::plan sizes q / o for it
    {
      std::vector<float> sink(size_t(b.attn_heads), 0.0f);  // padding heads: zero sinks
      std::memcpy(sink.data(), a.attn_sink->data + size_t(heads_lo) * 4, size_t(heads) * 4);
      b.sink = DeviceBuffer<float>(sink);
    }
    // wo_a: codes and UE8M0 scales as in the checkpoint, plus the tensor-core path's scales.
    check_fp8(a.wo_a);
    const int in_g = c.heads_per_group() * c.head_dim;
    DSV4_CHECK(a.wo_a.weight->shape[0] == int64_t(c.o_groups) * c.o_lora_rank &&
                   a.wo_a.weight->shape[1] == in_g,
               "tensor '", a.wo_a.weight->name, "': unexpected shape");
    const Fp8Rows wo_a =
        fp8_rows(a.wo_a, int64_t(groups_lo) * c.o_lora_rank, int64_t(groups) * c.o_lora_rank);
    b.wo_a.n = int(wo_a.weight.shape[0]);
    b.wo_a.k = int(wo_a.weight.shape[1]);
    b.wo_a.codes = upload_raw<uint8_t>(wo_a.weight);
    b.wo_a.scale_e8m0 = upload_raw<uint8_t>(wo_a.scale);
    b.wo_a_scale_rows.bits =
        DeviceBuffer<uint16_t>(cuda::wo_a_scale_rows_elems(groups, c.o_lora_rank, in_g));
    cuda::wo_a_prepare_scales(b.wo_a.scale_e8m0.data(), groups, c.o_lora_rank, in_g,
                              reinterpret_cast<__nv_bfloat16*>(b.wo_a_scale_rows.bits.data()),
                              nullptr);

    if (a.compressor) {
      const CompressorRef& cr = *a.compressor;
      std::vector<const TensorView*> rows{cr.wkv, cr.wgate};
      b.main_width = int(cr.wkv->shape[0]);
      b.main_ape = f32_tensor(cr.ape, "compressor ape");
      b.main_norm = bf16_tensor(cr.norm, "compressor norm");
      if (a.indexer) {
        const IndexerRef& ix = *a.indexer;
        rows.push_back(ix.compressor.wkv);
        rows.push_back(ix.compressor.wgate);
        b.index_width = int(ix.compressor.wkv->shape[0]);
        b.index_ape = f32_tensor(ix.compressor.ape, "indexer compressor ape");
        b.index_norm = bf16_tensor(ix.compressor.norm, "indexer compressor norm");
        b.index_wq_b = fp8(fp8_rows(ix.wq_b, int64_t(iheads_lo) * c.index_head_dim,
                                    int64_t(iheads) * c.index_head_dim)
                               .ref());
        DSV4_CHECK(ix.weights_proj, "CUDA weights: indexer weights_proj missing");
        const TensorView wproj = rows_of(*ix.weights_proj, iheads_lo, iheads);
        b.weights_proj = bf16_tensor(&wproj, "indexer weights_proj");
      }
      b.comp_rows = 2 * b.main_width + 2 * b.index_width;
      b.comp_proj = bf16_stack(rows);
    }

    if (experts == c.n_routed_experts) {
      b.moe = cuda::moe::upload_moe_weights(br.ffn);
    } else {
      // This rank's experts (their gate rows ride along, unused), and the whole router.
      DSV4_CHECK(br.ffn.gate && int(br.ffn.experts.size()) == c.n_routed_experts,
                 "CUDA weights: block ", br.index, " routed experts missing");
      MoeRef mine = br.ffn;
      mine.experts.assign(br.ffn.experts.begin() + experts_lo,
                          br.ffn.experts.begin() + experts_lo + experts);
      const TensorView gate = rows_of(*br.ffn.gate, experts_lo, experts);
      TensorView bias;
      mine.gate = &gate;
      if (br.ffn.bias) {
        bias = rows_of(*br.ffn.bias, experts_lo, experts);
        mine.bias = &bias;
      }
      mine.tid2eid = nullptr;
      b.moe_local = cuda::moe::upload_moe_weights(mine);
      b.experts_lo = experts_lo;
      b.moe = router_of(br.ffn, b.moe_local);
    }
    b.shared_inter = int(br.ffn.shared_w1.weight->shape[0]);
    b.shared_fused = b.shared_inter % 128 == 0;
    if (b.shared_fused) {
      b.shared_w13 = fp8_stack({&br.ffn.shared_w1, &br.ffn.shared_w3});
    } else {
      b.shared_w1 = fp8(br.ffn.shared_w1);
      b.shared_w3 = fp8(br.ffn.shared_w3);
    }
    b.shared_w2 = fp8(br.ffn.shared_w2);

    if (br.mtp) {
      b.has_mtp = true;
      b.e_proj = fp8(br.mtp->e_proj);
      b.h_proj = fp8(br.mtp->h_proj);
      b.enorm = bf16_tensor(br.mtp->enorm, "mtp enorm");
      b.hnorm = bf16_tensor(br.mtp->hnorm, "mtp hnorm");
      b.mtp_norm = bf16_tensor(br.mtp->norm, "mtp norm");
      b.mtp_hc_head = hc_unit(br.mtp->hc_head);
    }
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    m.blocks.push_back(std::move(b));
    report(int(m.blocks.size()) + 1);
  }
  m.device_bytes = free0 - free_device_bytes();
  return m;
}

}  // namespace dsv4
