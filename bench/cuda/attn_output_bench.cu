// Output path: grouped W8A16 wo_a (inverse RoPE fused or in place) at V4-Flash (64 heads,
// 8 groups x 1024) and V4-Pro (128 heads, 16 groups x 1024), M = 1 .. 8192 tokens (decode
// b = 1..256 with s_q 1 and 2, prefill 4K / 8K), both our paths where they apply, side by side
// with cuBLAS BF16 on the same grouped shape (strided-batched GEMM over the groups, weight
// dequantised to BF16 once). Also the in-place inverse RoPE alone. Weights and activations
// rotate through more memory than the L2 holds. The heads, groups and ranks are real_config.h's.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/bench_util.h"
#include "cuda/cublas_check.h"
#include "cuda/real_config.h"
#include "ops/cuda/attn_frontend/attn_frontend.h"
#include "ops/cuda/attn_output/attn_output.h"
#include "ops/cuda/common/device_buffer.h"

using namespace dsv4;
using cuda::DeviceBuffer;

namespace {

struct Model {
  const char* name;
  int heads, groups, o_lora;
  int in_g() const { return heads / groups * 512; }
  int rows() const { return groups * o_lora; }
};

// A real model's output projection (real_config.h); the head width 512 is the kernels'.
Model real_model(const char* name) {
  const ModelConfig c = bench::real_config(name, false);
  return {name, c.n_heads, c.o_groups, c.o_lora_rank};
}

std::vector<uint8_t> random_fp8(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& x : v) {
    x = uint8_t(rng());
    if ((x & 0x7f) == 0x7f) x = 0x38;  // no NaN
  }
  return v;
}
std::vector<uint16_t> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = uint16_t(0x3c00 | (rng() & 0x83ff));  // +-[2^-7, 2^-6)
  return v;
}

// Dequantises W (e4m3 x UE8M0 128x128) to BF16 for the cuBLAS baseline.
__global__ void dequant_kernel(const uint8_t* w, const uint8_t* s, int rows, int in,
                               __nv_bfloat16* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * in) return;
  const int r = int(i / in), k = int(i % in);
  __nv_fp8_e4m3 v;
  v.__x = w[i];
  const float sc = ldexpf(1.0f, int(s[int64_t(r / 128) * (in / 128) + k / 128]) - 127);
  out[i] = __float2bfloat16_rn(float(v) * sc);
}

void bench_model(const Model& m, cublasHandle_t handle) {
  const int rows = m.rows(), in_g = m.in_g();
  const size_t wbytes = size_t(rows) * in_g;
  const int wcopies = bench::rotation_copies(wbytes);
  std::vector<DeviceBuffer<uint8_t>> w, ws;
  std::vector<DeviceBuffer<uint16_t>> wsr, wbf;
  for (int c = 0; c < wcopies; ++c) {
    w.emplace_back(random_fp8(wbytes, 1 + c));
    std::vector<uint8_t> sc(size_t(rows / 128) * (in_g / 128));
    for (auto& x : sc) x = uint8_t(120 + (&x - sc.data()) % 5);
    ws.emplace_back(sc);
    wsr.emplace_back(cuda::wo_a_scale_rows_elems(m.groups, m.o_lora, in_g));
    cuda::wo_a_prepare_scales(ws.back().data(), m.groups, m.o_lora, in_g,
                              reinterpret_cast<__nv_bfloat16*>(wsr.back().data()));
  }
  // cuBLAS weights: BF16 (twice the bytes), rotated the same way.
  const int bcopies = bench::rotation_copies(wbytes * 2);
  for (int c = 0; c < bcopies; ++c) {
    wbf.emplace_back(wbytes);
    dequant_kernel<<<unsigned((wbytes + 255) / 256), 256>>>(
        w[c % wcopies].data(), ws[c % wcopies].data(), rows, in_g,
        reinterpret_cast<__nv_bfloat16*>(wbf.back().data()));
  }
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());

  std::vector<int> ms;
  for (int b : {1, 2, 32, 64, 128, 256})
    for (int sq : {1, 2}) ms.push_back(b * sq);
  ms.push_back(4096);
  ms.push_back(8192);
  for (int M : ms) {
    const size_t oelems = size_t(M) * m.heads * 512;
    const int acopies = bench::rotation_copies(oelems * 2);
    std::vector<DeviceBuffer<uint16_t>> o, z;
    for (int c = 0; c < acopies; ++c) {
      o.emplace_back(random_bf16(oelems, 50 + c));
      z.emplace_back(size_t(M) * rows);
    }
    std::vector<int32_t> pos(M);
    for (int t = 0; t < M; ++t) pos[t] = 16384 + t;
    DeviceBuffer<int32_t> d_pos(pos);
    DeviceBuffer<float> freq(std::vector<float>(32, 0.01f)), cs(size_t(M) * 64);
    cuda::RopeTableParams rp{d_pos.data(), freq.data(), M, reinterpret_cast<float2*>(cs.data())};
    cuda::rope_cos_sin(rp);

    const double flops = 2.0 * M * rows * in_g;
    auto ours = [&](cuda::WoAPath path) {
      return bench::median_us([&](int i) {
        cuda::WoAParams p;
        p.o = reinterpret_cast<__nv_bfloat16*>(o[i % acopies].data());
        p.cos_sin = rp.cos_sin;
        p.num_tokens = M;
        p.num_heads = m.heads;
        p.o_groups = m.groups;
        p.o_lora = m.o_lora;
        p.w = w[i % wcopies].data();
        p.w_scale = ws[i % wcopies].data();
        p.w_scale_rows = reinterpret_cast<const __nv_bfloat16*>(wsr[i % wcopies].data());
        p.z = reinterpret_cast<__nv_bfloat16*>(z[i % acopies].data());
        p.path = path;
        cuda::attn_output_wo_a(p);
      });
    };
    // cuBLAS (column-major): z_g^T [o_lora, M] = W_g [o_lora, in_g] . o_g^T, per group.
    const float alpha = 1.0f, beta = 0.0f;
    const double cublas_us = bench::median_us([&](int i) {
      CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_T, CUBLAS_OP_N, m.o_lora, M, in_g, &alpha, wbf[i % bcopies].data(),
          CUDA_R_16BF, in_g, int64_t(m.o_lora) * in_g, o[i % acopies].data(), CUDA_R_16BF,
          m.heads * 512, in_g, &beta, z[i % acopies].data(), CUDA_R_16BF, rows, m.o_lora, m.groups,
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    });
    const double bytes = double(wbytes) + double(oelems) * 2 + double(M) * rows * 2;
    std::vector<std::pair<cuda::WoAPath, const char*>> paths = {
        {cuda::WoAPath::kAuto, "wo_a auto"}, {cuda::WoAPath::kTensorCore, "wo_a tensor-core"}};
    if (M <= cuda::kWoAWeightStreamMaxM)
      paths.push_back({cuda::WoAPath::kWeightStream, "wo_a weight-stream"});
    for (const auto& [path, name] : paths) {
      bench::Result r;
      r.kernel = name;
      r.shape = std::string(m.name) + " M" + std::to_string(M);
      r.us = ours(path);
      r.flops = flops;
      r.bytes = bytes;
      r.peer = "cuBLAS BF16 strided-batched (dequantised W)";
      r.peer_us = cublas_us;
      r.emit();
    }
    // The inverse RoPE pass of the tensor-core path alone.
    bench::Result r;
    r.kernel = "inverse_rope_inplace";
    r.shape = std::string(m.name) + " M" + std::to_string(M);
    r.us = bench::median_us([&](int i) {
      cuda::inverse_rope_inplace(reinterpret_cast<__nv_bfloat16*>(o[i % acopies].data()),
                                 rp.cos_sin, M, m.heads);
    });
    r.bytes = double(M) * m.heads * 128 * 2;
    r.peer = "none (HBM roofline)";
    r.emit();
  }
}

}  // namespace

int main() {
  cublasHandle_t handle;
  CUBLAS_CHECK(cublasCreate(&handle));
  bench_model(real_model("flash"), handle);
  bench_model(real_model("pro"), handle);
  cublasDestroy(handle);
  return 0;
}
