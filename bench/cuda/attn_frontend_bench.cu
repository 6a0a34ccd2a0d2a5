// Attention front-end kernels at V4-Flash (64 heads) and V4-Pro (128 heads) shapes: q per-head
// RMS + RoPE, the fused window-KV entry (kv_norm + RoPE + FP8 + ring insert), the pure
// quantise-and-insert, and the RoPE table. Decode batches b = 1..256 with s_q 1 and 2 (ring
// insert), prefill 4K / 8K tokens (staged entries + decoded keys, what a prefill chunk uses).
// Inputs and outputs rotate through more memory than the L2 holds. No external peer computes
// these ops; they are judged against the HBM roofline (bytes they must move) or, below 32 MB,
// against the launch floor. The head counts are real_config.h's.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/bench_util.h"
#include "cuda/real_config.h"
#include "kvcache/cache_layout.h"
#include "ops/cuda/attn_frontend/attn_frontend.h"
#include "ops/cuda/common/device_buffer.h"

using namespace dsv4;
using cuda::DeviceBuffer;

namespace {

std::vector<uint16_t> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) {
    const float f = nd(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    x = uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  return v;
}

struct Batch {
  std::string label;
  int seqs = 0, per_seq = 0;
  int tokens() const { return seqs * per_seq; }
};

void bench_q(int heads, const std::string& model, const Batch& b) {
  const int T = b.tokens();
  const size_t elems = size_t(T) * heads * 512;
  const int copies = bench::rotation_copies(elems * 4);
  std::vector<DeviceBuffer<uint16_t>> in, out;
  for (int c = 0; c < copies; ++c) {
    in.emplace_back(random_bf16(elems, 11 + c));
    out.emplace_back(elems);
  }
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; ++t) pos[t] = 16384 + t;
  DeviceBuffer<int32_t> d_pos(pos);
  std::vector<float> freq(32);
  for (int i = 0; i < 32; ++i) freq[i] = std::pow(160000.0f, -float(2 * i) / 64.0f);
  DeviceBuffer<float> d_freq(freq), cs(size_t(T) * 64);
  cuda::RopeTableParams rp{d_pos.data(), d_freq.data(), T, reinterpret_cast<float2*>(cs.data())};
  cuda::rope_cos_sin(rp);
  const double us = bench::median_us([&](int i) {
    cuda::QNormRopeParams p;
    p.q = reinterpret_cast<const __nv_bfloat16*>(in[i % copies].data());
    p.out = reinterpret_cast<__nv_bfloat16*>(out[i % copies].data());
    p.cos_sin = rp.cos_sin;
    p.num_tokens = T;
    p.num_heads = heads;
    cuda::q_norm_rope(p);
  });
  bench::Result r;
  r.kernel = "q_norm_rope";
  r.shape = model + " H" + std::to_string(heads) + " " + b.label;
  r.us = us;
  r.bytes = double(elems) * 2 * 2 + double(T) * 256;
  r.peer = "none (HBM roofline)";
  r.emit();
}

void bench_kv(const Batch& b, bool fused, bool prefill) {
  const int T = b.tokens();
  const size_t elems = size_t(T) * 512;
  const int page_size = 64, window = 128, stride = window / page_size;
  const int copies = bench::rotation_copies(elems * 2 + size_t(T) * 584 * 2);
  KvEntryLayout l;
  std::vector<DeviceBuffer<uint16_t>> in, dec;
  std::vector<DeviceBuffer<uint8_t>> pages, staged;
  const int npages = b.seqs * stride;
  std::vector<int32_t> table(npages), seq(T), pos(T);
  for (int i = 0; i < npages; ++i) table[i] = i;
  for (int t = 0; t < T; ++t) {
    seq[t] = t / b.per_seq;
    pos[t] = 16384 + t % b.per_seq;
  }
  for (int c = 0; c < copies; ++c) {
    in.emplace_back(random_bf16(elems, 21 + c));
    if (prefill) {
      staged.emplace_back(size_t(T) * 584);
      dec.emplace_back(elems);
    } else {
      pages.emplace_back(size_t(npages) * l.page_bytes(page_size));
    }
  }
  DeviceBuffer<int32_t> d_table(table), d_seq(seq), d_pos(pos);
  DeviceBuffer<uint16_t> w(random_bf16(512, 5));
  std::vector<float> freq(32, 0.01f);
  DeviceBuffer<float> d_freq(freq), cs(size_t(T) * 64);
  cuda::RopeTableParams rp{d_pos.data(), d_freq.data(), T, reinterpret_cast<float2*>(cs.data())};
  cuda::rope_cos_sin(rp);
  const double us = bench::median_us([&](int i) {
    cuda::KvInsertParams p;
    p.kv = reinterpret_cast<const __nv_bfloat16*>(in[i % copies].data());
    p.norm_weight = reinterpret_cast<const __nv_bfloat16*>(w.data());
    p.cos_sin = rp.cos_sin;
    p.num_tokens = T;
    if (prefill) {
      p.staged = staged[i % copies].data();
      p.decoded = reinterpret_cast<__nv_bfloat16*>(dec[i % copies].data());
    } else {
      p.token_seq = d_seq.data();
      p.positions = d_pos.data();
      p.window = window;
      p.cache = cuda::kv_store_view(pages[i % copies].data(), page_size, d_table.data(), stride);
    }
    if (fused)
      cuda::kv_norm_rope_insert(p);
    else
      cuda::kv_quant_insert(p);
  });
  bench::Result r;
  r.kernel = fused ? "kv_norm_rope_insert" : "kv_quant_insert";
  r.shape = std::string(prefill ? "staged+decoded " : "ring ") + b.label;
  r.us = us;
  r.bytes = double(elems) * 2 + double(T) * 584 + (prefill ? double(elems) * 2 : 0.0);
  r.peer = "none (HBM roofline)";
  r.emit();
}

}  // namespace

int main() {
  std::vector<Batch> decode, prefill;
  for (int b : {1, 2, 32, 64, 128, 256})
    for (int sq : {1, 2})
      decode.push_back({"decode b" + std::to_string(b) + " s_q" + std::to_string(sq), b, sq});
  for (int n : {4096, 8192}) prefill.push_back({"prefill " + std::to_string(n), 1, n});
  for (const std::string model : {"flash", "pro"}) {
    const int heads = bench::real_config(model, false).n_heads;
    for (const auto& b : decode) bench_q(heads, model, b);
    for (const auto& b : prefill) bench_q(heads, model, b);
  }
  for (bool fused : {true, false}) {
    for (const auto& b : decode) bench_kv(b, fused, false);
    for (const auto& b : prefill) bench_kv(b, fused, true);
  }
  return 0;
}
