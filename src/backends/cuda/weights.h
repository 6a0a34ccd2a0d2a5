// The CUDA backend's working copy of the weights, built once from the checkpoint's views
// (WeightsRef) in the layouts the kernels read:
//  - FP8 linears: the checkpoint's e4m3 codes as they are, scales converted once to the fp32
//    transposed layout of gemm/ (fp8_weight_scales_to_f32);
//  - wo_a: e4m3 codes + UE8M0 scales + the per-row BF16 scales of attn_output/'s tensor-core
//    path (wo_a_prepare_scales);
//  - routed experts: repacked by moe/ (upload_moe_weights); the shared expert's w1 and w3 are
//    concatenated into one [2*inter, dim] FP8 matrix when inter is a multiple of 128 (one GEMM
//    at decode), else kept apart;
//  - compressor wkv/wgate of the main and the indexer compressor: one BF16 matrix
//    [main wkv | main wgate | indexer wkv | indexer wgate] rows (one fp32 cuBLAS GEMM per layer);
//  - BF16 tensors (embedding, head, norms, weights_proj) as their raw bits; F32 tensors as is.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "backends/cpu/weights.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/gemm/fp8_gemm.h"
#include "ops/cuda/mhc/mhc.h"
#include "ops/cuda/moe/moe.h"

namespace dsv4 {

using cuda::DeviceBuffer;

// BF16 device tensor as raw bits (the checkpoint's bytes).
struct CudaBf16 {
  DeviceBuffer<uint16_t> bits;
  const __nv_bfloat16* ptr() const { return reinterpret_cast<const __nv_bfloat16*>(bits.data()); }
  size_t size() const { return bits.size(); }
};

struct CudaFp8Linear {
  DeviceBuffer<uint8_t> codes;       // e4m3 [n, k]
  DeviceBuffer<float> scales_t;      // fp32 [k/128, ceil(n/128)]
  DeviceBuffer<uint8_t> scale_e8m0;  // the checkpoint's UE8M0 [ceil(n/128), k/128]
  // BF16 per-row scales [k/128, n] of the exact W8A16 path (w8a16_linear.h); empty for wo_a,
  // which keeps its own (CudaBlockWeights::wo_a_scale_rows).
  DeviceBuffer<uint16_t> scale_rows;
  int n = 0, k = 0;
  cuda::Fp8WeightView view() const { return {codes.data(), scales_t.data(), n, k}; }
  bool empty() const { return n == 0; }
};

struct CudaHcUnit {
  DeviceBuffer<float> fn, base, scale;
  cuda::HcUnitParams params() const { return {fn.data(), base.data(), scale.data()}; }
};

struct CudaBlockWeights {
  int index = 0;
  int ratio = 0;  // 0 (SWA only), 4 (CSA), 128 (HCA)
  CudaHcUnit hc_attn, hc_ffn;
  CudaBf16 attn_norm, ffn_norm;

  // Attention. heads: this rank's query heads (all on one rank); attn_heads: the heads the
  // attention kernels run — `heads` padded to a count the sparse attention takes
  // (cuda_attention_heads) with zero queries and zero sinks, whose outputs are dropped.
  int heads = 0, attn_heads = 0;
  CudaFp8Linear wq_a, wq_b, wkv, wo_b;
  CudaBf16 q_norm, kv_norm;
  DeviceBuffer<float> sink;  // [attn_heads]
  CudaFp8Linear wo_a;        // codes + scale_e8m0 (+ scales_t unused)
  CudaBf16 wo_a_scale_rows;  // attn_output's per-row scales (tensor-core path)
  // Compressor projections (ratio > 0): rows [main wkv | main wgate | idx wkv | idx wgate].
  CudaBf16 comp_proj;
  int comp_rows = 0;    // rows of comp_proj
  int main_width = 0;   // coff * head_dim of the main compressor
  int index_width = 0;  // coff * index_head_dim (CSA), else 0
  DeviceBuffer<float> main_ape, index_ape;
  CudaBf16 main_norm, index_norm;
  // Lightning indexer (CSA).
  CudaFp8Linear index_wq_b;
  CudaBf16 weights_proj;  // [index_heads, dim]

  // MoE. One rank: `moe` holds the router and every routed expert. A rank of the parallel
  // engine with a share of the experts: `moe` holds the router alone (n_experts = all, no
  // expert weights) and `moe_local` the experts [experts_lo, experts_lo + its n_experts).
  cuda::moe::MoeDeviceWeights moe;
  cuda::moe::MoeDeviceWeights moe_local;
  int experts_lo = 0;
  bool shared_fused = false;           // shared_w13 holds [w1; w3]
  CudaFp8Linear shared_w13;            // fused: [2*inter, dim]
  CudaFp8Linear shared_w1, shared_w3;  // not fused
  CudaFp8Linear shared_w2;
  int shared_inter = 0;

  // MTP block extras.
  bool has_mtp = false;
  CudaFp8Linear e_proj, h_proj;
  CudaBf16 enorm, hnorm, mtp_norm;
  CudaHcUnit mtp_hc_head;
};

struct CudaModelWeights {
  CudaBf16 embed, head, norm;  // [vocab, dim], [vocab, dim], [dim]
  CudaHcUnit hc_head;
  DeviceBuffer<float> inv_freq_plain, inv_freq_yarn;  // [rope_dim/2] RoPE tables of the layer kinds
  std::vector<CudaBlockWeights> blocks;               // decoder blocks, then MTP blocks
  size_t device_bytes = 0;                            // device memory the weights took

  const float* inv_freq(int ratio) const {
    return ratio > 0 ? inv_freq_yarn.data() : inv_freq_plain.data();
  }
};

// The smallest head count >= heads the sparse attention kernels take (4, 8 or a multiple of
// 16): a tensor-parallel share of a model's heads may be fewer (the tiny flash preset's 4 heads
// at tp 2).
int cuda_attention_heads(int heads);

// Throws dsv4::Error naming every feature of `c` the CUDA backend does not run (checked before
// any upload, so an unsupported model fails fast).
void check_cuda_supported(const ModelConfig& c);

// Uploads and repacks every tensor (synchronously). `progress`: a progress bar on stderr.
// `shard`: one rank of the parallel engine keeps only its rows of wq_b and the sinks (heads),
// wo_a (output groups), the indexer's wq_b and weights_proj (index heads) and its routed
// experts; a split that does not fall on the FP8 scale blocks (128 rows) is an error.
CudaModelWeights upload_cuda_weights(const ModelConfig& c, const WeightsRef& ref, bool progress,
                                     const cpu::WeightShard& shard = {});

}  // namespace dsv4
