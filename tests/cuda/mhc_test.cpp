// mHC on the GPU (ops/cuda/mhc/mhc.h) against the CPU reference (ops/cpu/mhc.h, norm.h):
// hc_pre, hc_post, the fused hc_post_pre, hc_head, each with and without the fused RMSNorm, at
// tiny, Flash (4096: a 16-CTA cluster) and Pro (7168: 14 CTAs) widths, token counts that are not
// tile multiples and the real decode/prefill counts (1, 128, 8192), poisoned outputs and in-place
// streams; and the per-token kernel that serves the other widths (128 and 384 at decode and
// prefill counts, 8 .. 16384 at the edges) under the same contract. hc_post_pre takes two routes
// (the fused kernel for one m-tile per cluster tile, else hc_post then hc_pre); both are checked.
// Widths that are a multiple of 32 (up to 8192) take the split-K path (mhc_split.h) at every
// token count by default, so the older cases above run it at those widths; the Split* cases force
// it and the cluster kernel at the same real shapes (b 1, 2, 8, 32, 128 at 4096 and 7168), edge
// sizes and prefill sizes, under the same contract, and check that it is deterministic; the
// TokenPath* cases force the per-token kernel, ClusterForcedPrefill the cluster kernel. On the
// split path hc_post_pre also takes two routes (hc_post fused into the projection up to 128 tokens,
// else the streaming hc_post then the split hc_pre): SplitPostPreRealShapes / SplitEdgeSizes check
// the first, SplitSpeculativeShapes / SplitForcedPrefill / PostPreRealShapes (8192) the second. Its
// projection sums the same exact products (BF16 x the 3 BF16 parts of fn) in a shorter fp32 chain
// per CTA (at most 2 d-chunks: 12 MMA k-steps), the 4 warps in fp32 and the CTAs in fp64: within
// the verify bound's model (mix_bound: one BF16-MMA chain over all 3n products), so the tolerances
// below are unchanged. hc_post's arithmetic is the CPU's operation for operation, so its streams
// must match bit for bit; the collapsed y must meet the tolerance (relative L2 <= 4e-3, >=
// 99% within 1 BF16 ulp) and post/comb (fp32, values of order 1) agree to 1e-4 absolute (fp32
// summation-order noise is ~1e-6).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/formats.h"
#include "core/rng.h"
#include "cuda/cuda_support.h"
#include "cuda/gpu_test.h"
#include "ops/cpu/mhc.h"
#include "ops/cpu/norm.h"
#include "ops/cuda/common/device.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/gemm/fp8_gemm.h"
#include "ops/cuda/mhc/mhc.h"
#include "ops/cuda/mhc/mhc_config.h"
#include "ops/cuda/mhc/mhc_split.h"
#include "support/bf16_compare.h"
#include "support/bf16_vectors.h"
#include "support/random_values.h"

namespace dsv4 {
namespace {

using cuda::DeviceBuffer;
using test::bf16_ptr;
using test::expect_bf16_close;
using test::from_bf16_bits;
using test::random_bf16;
using test::to_bf16_bits;
constexpr int kHc = 4;

// Runs f(t) for every token t on up to 16 host threads: the CPU references (one token at a
// time, independent) dominate this test's time at the real widths.
template <typename F>
void parallel_for(int n, F f) {
  const int workers = std::max(1, std::min({16, n, int(std::thread::hardware_concurrency())}));
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&] {
      for (int i = next++; i < n; i = next++) f(i);
    });
  for (std::thread& th : pool) th.join();
}

void expect_bits_equal(const std::vector<uint16_t>& got, const std::vector<float>& ref, int cols,
                       const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < ref.size(); ++i)
    if (got[i] != float_to_bf16(ref[i])) {
      if (first < 0) first = int64_t(i);
      ++bad;
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " differ; first ["
                    << first / std::max(cols, 1) << ", " << first % std::max(cols, 1) << "]: got "
                    << (first >= 0 ? bf16_to_float(got[first]) : 0.f) << " want "
                    << (first >= 0 ? ref[first] : 0.f);
}

void expect_f32_close(const std::vector<float>& got, const std::vector<float>& ref, double tol,
                      const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  double worst = 0;
  int64_t at = -1;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::isnan(got[i]) ? 1e30 : std::fabs(double(got[i]) - ref[i]);
    if (d > worst) worst = d, at = int64_t(i);
  }
  EXPECT_LE(worst, tol) << what << ": worst |diff| at " << at << ": got "
                        << (at >= 0 ? got[at] : 0.f) << " want " << (at >= 0 ? ref[at] : 0.f);
  std::printf("[ metric ] %s max_abs_diff=%.3g\n", what.c_str(), worst);
}

// Random HC unit with the checkpoint's magnitudes (fn small, base and scale O(1)).
struct Unit {
  std::vector<float> fn, base, scale;
};
Unit random_unit(Rng& rng, int mix, int dim, int nscale) {
  Unit u;
  u.fn.resize(size_t(mix) * kHc * dim);
  for (auto& v : u.fn) v = float(rng.normal()) * 0.02f;
  u.base.resize(mix);
  for (auto& v : u.base) v = float(rng.normal());
  u.scale.resize(nscale);
  for (auto& v : u.scale) v = float(rng.uniform(0.2, 2.0));
  return u;
}
struct DevUnit {
  DeviceBuffer<float> fn, base, scale;
  explicit DevUnit(const Unit& u) : fn(u.fn), base(u.base), scale(u.scale) {}
  cuda::HcUnitParams params() const { return {fn.data(), base.data(), scale.data()}; }
};

std::vector<float> random_streams(Rng& rng, int tokens, int dim) {
  std::vector<float> s(size_t(tokens) * kHc * dim);
  for (int t = 0; t < tokens; ++t) {
    const float mag = std::ldexp(1.0f, int(rng.below(6)) - 3);  // per-token scale
    for (int i = 0; i < kHc * dim; ++i)
      s[size_t(t) * kHc * dim + i] = round_bf16(float(rng.normal()) * mag);
  }
  return s;
}

cpu::HcParams cpu_params(const Unit& u, int dim) {
  cpu::HcParams p;
  p.hc = kHc;
  p.dim = dim;
  p.fn = u.fn.data();
  p.base = u.base.data();
  p.scale = u.scale.data();
  return p;
}

cuda::HcShape shape(int dim) {
  cuda::HcShape s;
  s.dim = dim;
  return s;
}

const char* path_name(cuda::HcPath path) {
  return path == cuda::HcPath::kSplit     ? " [split]"
         : path == cuda::HcPath::kCluster ? " [cluster]"
                                          : "";
}

class CudaMhc : public test::GpuTest {};

// The GPU ops' parameters (norm_w null: no fused norm).
cuda::HcPreParams pre_params(int dim, int tokens, const cuda::HcUnitParams& unit,
                             const __nv_bfloat16* streams, const __nv_bfloat16* norm_w,
                             __nv_bfloat16* y, float* post, float* comb, cuda::HcPath path) {
  cuda::HcPreParams p;
  p.shape = shape(dim);
  p.tokens = tokens;
  p.streams = streams;
  p.unit = unit;
  p.norm = {norm_w, 1e-6f};
  p.y = y;
  p.post = post;
  p.comb = comb;
  p.path = path;
  return p;
}
// x, res, post, comb: the sub-layer's output, the streams before it and its mixing; out: the new
// streams; y, next_post, next_comb: the next sub-layer's input and mixing.
cuda::HcPostPreParams post_pre_params(int dim, int tokens, const cuda::HcUnitParams& unit,
                                      const __nv_bfloat16* x, const __nv_bfloat16* res,
                                      const float* post, const float* comb, __nv_bfloat16* out,
                                      const __nv_bfloat16* norm_w, __nv_bfloat16* y,
                                      float* next_post, float* next_comb, cuda::HcPath path) {
  cuda::HcPostPreParams p;
  p.post.shape = shape(dim);
  p.post.tokens = tokens;
  p.post.x = x;
  p.post.res = res;
  p.post.post = post;
  p.post.comb = comb;
  p.post.out = out;
  p.unit = unit;
  p.norm = {norm_w, 1e-6f};
  p.y = y;
  p.next_post = next_post;
  p.next_comb = next_comb;
  p.path = path;
  return p;
}

// hc_post_pre's random inputs: the HC unit, the streams before the sub-layer (res), its output
// x, its post / comb, the next norm's weight.
struct PostPreInputs {
  Unit u;
  std::vector<float> res, x, post, comb, nw;
};
PostPreInputs random_post_pre_inputs(Rng& rng, int dim, int tokens) {
  PostPreInputs in;
  in.u = random_unit(rng, (2 + kHc) * kHc, dim, 3);
  in.res = random_streams(rng, tokens, dim);
  in.x = random_bf16(rng, size_t(tokens) * dim, 1.0f);
  in.post.resize(size_t(tokens) * kHc);
  in.comb.resize(size_t(tokens) * kHc * kHc);
  for (auto& v : in.post) v = float(rng.uniform(0.0, 2.0));
  for (auto& v : in.comb) v = float(rng.uniform(0.0, 1.0));
  in.nw.resize(dim);
  for (auto& v : in.nw) v = round_bf16(float(rng.uniform(0.5, 1.5)));
  return in;
}

// hc_pre (+ optional fused norm) on the GPU vs CPU hc_pre (+ rms_norm).
void check_pre(int dim, int tokens, bool norm, uint64_t seed,
               cuda::HcPath path = cuda::HcPath::kAuto) {
  Rng rng(seed);
  const Unit u = random_unit(rng, (2 + kHc) * kHc, dim, 3);
  const std::vector<float> streams = random_streams(rng, tokens, dim);
  std::vector<float> nw(dim);
  for (auto& v : nw) v = round_bf16(float(rng.uniform(0.5, 1.5)));
  // CPU
  const cpu::HcParams cp = cpu_params(u, dim);
  std::vector<float> y(size_t(tokens) * dim), post(size_t(tokens) * kHc),
      comb(size_t(tokens) * kHc * kHc);
  parallel_for(tokens, [&](int t) {
    cpu::hc_pre(cp, streams.data() + size_t(t) * kHc * dim, y.data() + size_t(t) * dim,
                post.data() + size_t(t) * kHc, comb.data() + size_t(t) * kHc * kHc);
  });
  if (norm) cpu::rms_norm(y.data(), tokens, dim, nw.data(), 1e-6f, y.data());
  // GPU
  const DevUnit du(u);
  DeviceBuffer<uint16_t> ds(to_bf16_bits(streams)), dnw(to_bf16_bits(nw)), dy(size_t(tokens) * dim);
  DeviceBuffer<float> dpost(size_t(tokens) * kHc), dcomb(size_t(tokens) * kHc * kHc);
  dy.fill_bytes(0xff);
  dpost.fill_bytes(0xff);
  dcomb.fill_bytes(0xff);
  cuda::hc_pre(pre_params(dim, tokens, du.params(), bf16_ptr(ds), norm ? bf16_ptr(dnw) : nullptr,
                          bf16_ptr(dy), dpost.data(), dcomb.data(), path),
               nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::string what =
      cat("hc_pre dim=", dim, " tokens=", tokens, norm ? " +norm" : "", path_name(path));
  expect_bf16_close(from_bf16_bits(dy.download()), y, dim, what + " y");
  expect_f32_close(dpost.download(), post, 1e-4, what + " post");
  expect_f32_close(dcomb.download(), comb, 1e-4, what + " comb");
}

TEST_F(CudaMhc, Smoke) {
  check_pre(256, 4, false, 1);
}

TEST_F(CudaMhc, PreTinyWidths) {
  uint64_t seed = 10;
  for (int dim : {256, 512, 768, 1024})
    for (int tokens : {1, 3, 17}) check_pre(dim, tokens, false, seed++);
  // Small clusters over many tokens: a CTA owns more tokens than warp 8 has lanes (5000 tokens
  // over ~132 one-CTA clusters, or ~66 two-CTA clusters, is ~38 owned tokens per CTA).
  check_pre(256, 5000, false, seed++);
  check_pre(512, 5000, true, seed++);
}

TEST_F(CudaMhc, PreFlash) {
  uint64_t seed = 20;
  for (int tokens : {1, 3, 17, 63, 65, 100, 1000}) check_pre(4096, tokens, false, seed++);
}

TEST_F(CudaMhc, PrePro) {
  uint64_t seed = 30;
  for (int tokens : {1, 17, 65, 200}) check_pre(7168, tokens, false, seed++);
}

TEST_F(CudaMhc, PreWithFusedNorm) {
  uint64_t seed = 40;
  check_pre(256, 5, true, seed++);
  check_pre(4096, 70, true, seed++);
  check_pre(7168, 33, true, seed++);
}

// The engine's configuration (fused attn/ffn norm) at the real widths, decode (1), a decode
// batch (128) and prefill (8192: many cluster waves of full token tiles).
TEST_F(CudaMhc, PreRealShapes) {
  uint64_t seed = 80;
  for (int dim : {4096, 7168})
    for (int tokens : {1, 128, 8192}) check_pre(dim, tokens, true, seed++);
}

// hc_post on the GPU vs the CPU, bit for bit (out-of-place and in place).
void check_post(int dim, int tokens, bool in_place, uint64_t seed) {
  Rng rng(seed);
  const std::vector<float> res = random_streams(rng, tokens, dim);
  const std::vector<float> x = random_bf16(rng, size_t(tokens) * dim, 1.0f);
  std::vector<float> post(size_t(tokens) * kHc), comb(size_t(tokens) * kHc * kHc);
  for (auto& v : post) v = float(rng.uniform(0.0, 2.0));
  for (auto& v : comb) v = float(rng.uniform(0.0, 1.0));
  std::vector<float> out(res.size());
  for (int t = 0; t < tokens; ++t)
    cpu::hc_post(kHc, dim, x.data() + size_t(t) * dim, res.data() + size_t(t) * kHc * dim,
                 post.data() + size_t(t) * kHc, comb.data() + size_t(t) * kHc * kHc,
                 out.data() + size_t(t) * kHc * dim);
  DeviceBuffer<uint16_t> dres(to_bf16_bits(res)), dx(to_bf16_bits(x)), dout(res.size());
  DeviceBuffer<float> dpost(post), dcomb(comb);
  dout.fill_bytes(0xff);
  cuda::HcPostParams p;
  p.shape = shape(dim);
  p.tokens = tokens;
  p.x = bf16_ptr(dx);
  p.res = bf16_ptr(dres);
  p.post = dpost.data();
  p.comb = dcomb.data();
  p.out = in_place ? bf16_ptr(dres) : bf16_ptr(dout);
  cuda::hc_post(p, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  expect_bits_equal(in_place ? dres.download() : dout.download(), out, kHc * dim,
                    cat("hc_post dim=", dim, " tokens=", tokens, in_place ? " in place" : ""));
}

TEST_F(CudaMhc, PostBitExact) {
  uint64_t seed = 50;
  for (int dim : {256, 4096, 7168})
    for (int tokens : {1, 3, 65}) check_post(dim, tokens, false, seed++);
  check_post(4096, 17, true, seed++);
}

// Fused hc_post + hc_pre vs the CPU's two steps; streams bit-exact, y/post/comb within tolerance.
void check_post_pre(int dim, int tokens, bool norm, bool in_place, uint64_t seed,
                    cuda::HcPath path = cuda::HcPath::kAuto) {
  Rng rng(seed);
  const PostPreInputs in = random_post_pre_inputs(rng, dim, tokens);
  const Unit& u = in.u;
  const std::vector<float>&res = in.res, &x = in.x, &post = in.post, &comb = in.comb, &nw = in.nw;
  // CPU: hc_post then hc_pre (+ norm).
  std::vector<float> streams(res.size()), y(size_t(tokens) * dim), npost(post.size()),
      ncomb(comb.size());
  const cpu::HcParams cp = cpu_params(u, dim);
  parallel_for(tokens, [&](int t) {
    cpu::hc_post(kHc, dim, x.data() + size_t(t) * dim, res.data() + size_t(t) * kHc * dim,
                 post.data() + size_t(t) * kHc, comb.data() + size_t(t) * kHc * kHc,
                 streams.data() + size_t(t) * kHc * dim);
    cpu::hc_pre(cp, streams.data() + size_t(t) * kHc * dim, y.data() + size_t(t) * dim,
                npost.data() + size_t(t) * kHc, ncomb.data() + size_t(t) * kHc * kHc);
  });
  if (norm) cpu::rms_norm(y.data(), tokens, dim, nw.data(), 1e-6f, y.data());
  // GPU
  const DevUnit du(u);
  DeviceBuffer<uint16_t> dres(to_bf16_bits(res)), dx(to_bf16_bits(x)), dout(res.size()),
      dnw(to_bf16_bits(nw)), dy(size_t(tokens) * dim);
  DeviceBuffer<float> dpost(post), dcomb(comb), dnpost(post.size()), dncomb(comb.size());
  dout.fill_bytes(0xff);
  dy.fill_bytes(0xff);
  dnpost.fill_bytes(0xff);
  dncomb.fill_bytes(0xff);
  // In place: the new post/comb overwrite the old ones too.
  cuda::hc_post_pre(
      post_pre_params(
          dim, tokens, du.params(), bf16_ptr(dx), bf16_ptr(dres), dpost.data(), dcomb.data(),
          in_place ? bf16_ptr(dres) : bf16_ptr(dout), norm ? bf16_ptr(dnw) : nullptr, bf16_ptr(dy),
          in_place ? dpost.data() : dnpost.data(), in_place ? dcomb.data() : dncomb.data(), path),
      nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::string what = cat("hc_post_pre dim=", dim, " tokens=", tokens, norm ? " +norm" : "",
                               in_place ? " in place" : "", path_name(path));
  expect_bits_equal(in_place ? dres.download() : dout.download(), streams, kHc * dim,
                    what + " streams");
  expect_bf16_close(from_bf16_bits(dy.download()), y, dim, what + " y");
  expect_f32_close(in_place ? dpost.download() : dnpost.download(), npost, 1e-4, what + " post");
  expect_f32_close(in_place ? dcomb.download() : dncomb.download(), ncomb, 1e-4, what + " comb");
}

TEST_F(CudaMhc, PostPreFused) {
  uint64_t seed = 60;
  check_post_pre(256, 3, false, false, seed++);
  check_post_pre(4096, 1, false, false, seed++);
  check_post_pre(4096, 65, true, false, seed++);
  check_post_pre(4096, 300, false, true, seed++);
  check_post_pre(7168, 17, true, true, seed++);
  check_post_pre(7168, 100, false, false, seed++);
}

// The engine's fused post+pre (in place, next norm fused) at the real widths. 1 and 128 tokens
// run the fused cluster kernel (one m-tile per cluster tile); 8192 tokens take the streaming
// hc_post then hc_pre (several m-tiles per tile), which must give the same results.
TEST_F(CudaMhc, PostPreRealShapes) {
  uint64_t seed = 90;
  for (int dim : {4096, 7168})
    for (int tokens : {1, 128, 8192}) check_post_pre(dim, tokens, true, true, seed++);
  check_post_pre(4096, 8192, false, false, seed++);  // out of place, no norm
}

// hc_head (+ the final norm) vs the CPU.
void check_head(int dim, int tokens, bool norm, uint64_t seed,
                cuda::HcPath path = cuda::HcPath::kAuto) {
  Rng rng(seed);
  const Unit u = random_unit(rng, kHc, dim, 1);
  const std::vector<float> streams = random_streams(rng, tokens, dim);
  std::vector<float> nw(dim);
  for (auto& v : nw) v = round_bf16(float(rng.uniform(0.5, 1.5)));
  std::vector<float> y(size_t(tokens) * dim);
  const cpu::HcParams cp = cpu_params(u, dim);
  parallel_for(tokens, [&](int t) {
    cpu::hc_head(cp, streams.data() + size_t(t) * kHc * dim, y.data() + size_t(t) * dim);
  });
  if (norm) cpu::rms_norm(y.data(), tokens, dim, nw.data(), 1e-6f, y.data());
  const DevUnit du(u);
  DeviceBuffer<uint16_t> ds(to_bf16_bits(streams)), dnw(to_bf16_bits(nw)), dy(size_t(tokens) * dim);
  dy.fill_bytes(0xff);
  cuda::HcHeadParams p;
  p.shape = shape(dim);
  p.tokens = tokens;
  p.streams = bf16_ptr(ds);
  p.unit = du.params();
  if (norm) p.norm = {bf16_ptr(dnw), 1e-6f};
  p.y = bf16_ptr(dy);
  p.path = path;
  cuda::hc_head(p, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  expect_bf16_close(
      from_bf16_bits(dy.download()), y, dim,
      cat("hc_head dim=", dim, " tokens=", tokens, norm ? " +norm" : "", path_name(path)));
}

TEST_F(CudaMhc, Head) {
  uint64_t seed = 70;
  check_head(256, 2, false, seed++);
  check_head(4096, 17, true, seed++);
  check_head(4096, 130, false, seed++);
  check_head(7168, 5, true, seed++);
}

// ---- widths the cluster kernel does not take: the per-token kernel (mhc_token.h) -------------
// The same contract as above. dim 128 is the custom-config test's width, 384 another multiple of
// 128 that is not one of 256; decode batches (1-16 tokens) and prefill counts (300, 2048).
constexpr int kOddWidths[] = {128, 384};
// Widths that are a multiple of 32 take the split path by default; kCluster forces the kernels of
// mhc.cu, which at these widths is the per-token kernel.
constexpr cuda::HcPath kTokenPath = cuda::HcPath::kCluster;

TEST_F(CudaMhc, TokenPathPreDecode) {
  uint64_t seed = 200;
  for (int dim : kOddWidths)
    for (int tokens : {1, 2, 5, 16}) {
      check_pre(dim, tokens, false, seed++, kTokenPath);
      check_pre(dim, tokens, true, seed++, kTokenPath);
    }
}

TEST_F(CudaMhc, TokenPathPrePrefill) {
  uint64_t seed = 220;
  for (int dim : kOddWidths)
    for (int tokens : {300, 2048}) {
      check_pre(dim, tokens, false, seed++, kTokenPath);
      check_pre(dim, tokens, true, seed++, kTokenPath);
    }
}

TEST_F(CudaMhc, TokenPathPostBitExact) {
  uint64_t seed = 240;
  for (int dim : kOddWidths)
    for (int tokens : {1, 16, 300}) check_post(dim, tokens, false, seed++);
  check_post(128, 2048, true, seed++);
}

// hc_post_pre on these widths is the streaming hc_post, then the per-token hc_pre: in place with
// the next norm fused (the engine's configuration) and out of place without it.
TEST_F(CudaMhc, TokenPathPostPre) {
  uint64_t seed = 260;
  for (int dim : kOddWidths)
    for (int tokens : {1, 3, 16, 300, 2048})
      check_post_pre(dim, tokens, true, true, seed++, kTokenPath);
  check_post_pre(128, 16, false, false, seed++, kTokenPath);
  check_post_pre(384, 300, false, false, seed++, kTokenPath);
}

TEST_F(CudaMhc, TokenPathHead) {
  uint64_t seed = 280;
  for (int dim : kOddWidths)
    for (int tokens : {1, 16, 300, 2048})
      check_head(dim, tokens, tokens % 2 == 0, seed++, kTokenPath);
}

// The per-token kernel's other widths: the smallest (8: one warp, 4 chunks of streams, one of
// y), one that is not a multiple of 128 (136), a multiple of 256 past the 16-CTA cluster (4352 =
// 17 x 256) and the largest (16384 = 32 x 512: 256 threads, 32 chunks each).
TEST_F(CudaMhc, TokenPathOtherWidths) {
  uint64_t seed = 300;
  for (int dim : {8, 136, 4352, 16384}) {
    ASSERT_FALSE(cuda::mhc_cfg::uses_cluster_kernel(dim)) << dim;
    check_pre(dim, 3, true, seed++, kTokenPath);
    check_post_pre(dim, 17, true, true, seed++, kTokenPath);
    check_head(dim, 2, true, seed++, kTokenPath);
  }
}

// ---- the split-K decode path (mhc_split.h) -----------------------------------------------------
// Decode batches at the real widths take it by default (kAuto); every shape is also forced onto
// each path, so the split path and the cluster kernel meet the same contract at the same shapes.
constexpr int kDecodeBatches[] = {1, 2, 8, 32, 128};

TEST_F(CudaMhc, SplitPreRealShapes) {
  uint64_t seed = 400;
  for (int dim : {4096, 7168})
    for (int tokens : kDecodeBatches) {
      ASSERT_TRUE(cuda::mhc_cfg::uses_split_kernel(dim, tokens)) << dim << " " << tokens;
      check_pre(dim, tokens, true, seed++, cuda::HcPath::kSplit);
      check_pre(dim, tokens, false, seed++, cuda::HcPath::kSplit);
      check_pre(dim, tokens, true, seed++, cuda::HcPath::kCluster);
    }
}

// The engine's configuration (new streams to the other buffer, the next norm fused), in place with
// post/comb aliased too, no norm, and the cluster kernel at the same shapes.
TEST_F(CudaMhc, SplitPostPreRealShapes) {
  uint64_t seed = 500;
  for (int dim : {4096, 7168})
    for (int tokens : kDecodeBatches) {
      check_post_pre(dim, tokens, true, false, seed++, cuda::HcPath::kSplit);
      check_post_pre(dim, tokens, true, true, seed++, cuda::HcPath::kSplit);
      check_post_pre(dim, tokens, false, false, seed++, cuda::HcPath::kSplit);
      check_post_pre(dim, tokens, true, false, seed++, cuda::HcPath::kCluster);
    }
}

TEST_F(CudaMhc, SplitHeadRealShapes) {
  uint64_t seed = 600;
  for (int dim : {4096, 7168})
    for (int tokens : kDecodeBatches) {
      check_head(dim, tokens, true, seed++, cuda::HcPath::kSplit);
      check_head(dim, tokens, false, seed++, cuda::HcPath::kSplit);
    }
}

// Decode steps with a speculative draft (b = 64 / 128 with 3 draft tokens: 256 / 512 rows) take the
// split path by default too (many tiles of 64 tokens, several d-chunks per split).
TEST_F(CudaMhc, SplitSpeculativeShapes) {
  uint64_t seed = 650;
  for (int dim : {4096, 7168})
    for (int tokens : {256, 512}) {
      ASSERT_TRUE(cuda::mhc_cfg::uses_split_kernel(dim, tokens));
      check_pre(dim, tokens, true, seed++);
      check_post_pre(dim, tokens, true, false, seed++);
    }
}

// Edge sizes: token counts that fill no tile (3, 17, 33, 65, 127 over tiles of 16, 32 and 64
// rows) or exactly (16, 64); the smallest width (32: one d-chunk, one split), widths whose splits
// are uneven (96, 1056), one the cluster kernel does not take (384, the per-token kernel's), and
// the largest (8192: 256 d-chunks, 5 chunks of y per collapse thread).
TEST_F(CudaMhc, SplitEdgeSizes) {
  uint64_t seed = 700;
  for (int tokens : {3, 16, 17, 33, 64, 65, 127}) {
    check_pre(4096, tokens, true, seed++, cuda::HcPath::kSplit);
    check_post_pre(7168, tokens, true, true, seed++, cuda::HcPath::kSplit);
  }
  for (int dim : {32, 96, 384, 1056, 8192})
    for (int tokens : {1, 5, 40, 128}) {
      check_pre(dim, tokens, tokens % 2 == 0, seed++, cuda::HcPath::kSplit);
      check_post_pre(dim, tokens, true, tokens % 2 == 1, seed++, cuda::HcPath::kSplit);
      check_head(dim, tokens, true, seed++, cuda::HcPath::kSplit);
    }
}

// Forced at prefill sizes (many tiles of 64 tokens; splits of many d-chunks, down to one split
// per tile): the same contract, so the benchmark's comparison with the cluster kernel is sound.
TEST_F(CudaMhc, SplitForcedPrefill) {
  uint64_t seed = 750;
  check_pre(4096, 1000, true, seed++, cuda::HcPath::kSplit);
  // From kSplitStagedMinTokens the projection stages the streams through shared memory: at the
  // threshold, a partial last tile, Pro's width (14 d-chunks a split) and hc_head.
  check_pre(4096, 1024, false, seed++, cuda::HcPath::kSplit);
  check_pre(4096, 1025, true, seed++, cuda::HcPath::kSplit);
  check_pre(7168, 1100, true, seed++, cuda::HcPath::kSplit);
  check_head(4096, 1100, true, seed++, cuda::HcPath::kSplit);
  check_pre(7168, 300, false, seed++, cuda::HcPath::kSplit);
  check_post_pre(4096, 2048, true, false, seed++, cuda::HcPath::kSplit);
  check_post_pre(7168, 700, true, true, seed++, cuda::HcPath::kSplit);
  check_head(4096, 500, true, seed++, cuda::HcPath::kSplit);
}

// The staged projection and finishing kernels (prefill sizes) at narrow widths: cheap enough for
// the emulator in CI (scripts/kemu/ci_cases.txt); d-chunks fewer than the stages, a partial
// last tile, hc_head, a ring that wraps.
TEST_F(CudaMhc, SplitStagedNarrow) {
  uint64_t seed = 770;
  check_pre(128, 1024, true, seed++, cuda::HcPath::kSplit);
  check_pre(256, 1090, false, seed++, cuda::HcPath::kSplit);
  check_head(128, 1030, true, seed++, cuda::HcPath::kSplit);
  // 33 tiles of 64: 8 splits of 4 d-chunks, so the 4-stage ring wraps.
  check_pre(1024, 2100, true, seed++, cuda::HcPath::kSplit);
}

// The cluster kernel, which kAuto no longer runs at these widths, at prefill sizes (several
// m-tiles per cluster tile; hc_post_pre as hc_post then hc_pre).
TEST_F(CudaMhc, ClusterForcedPrefill) {
  uint64_t seed = 780;
  check_pre(4096, 8192, true, seed++, cuda::HcPath::kCluster);
  check_post_pre(7168, 4096, true, true, seed++, cuda::HcPath::kCluster);
  check_post_pre(4096, 2048, false, false, seed++, cuda::HcPath::kCluster);
  check_head(7168, 1000, true, seed++, cuda::HcPath::kCluster);
}

// The split path's reductions are in a fixed order: the same inputs give the same bits, also
// after a larger shape has used (and left its partials in) the shared workspace.
TEST_F(CudaMhc, SplitDeterministic) {
  Rng rng(800);
  const int dim = 7168, tokens = 8;
  const Unit u = random_unit(rng, (2 + kHc) * kHc, dim, 3);
  const std::vector<float> streams = random_streams(rng, 128, dim);
  std::vector<float> nw(dim);
  for (auto& v : nw) v = round_bf16(float(rng.uniform(0.5, 1.5)));
  const DevUnit du(u);
  DeviceBuffer<uint16_t> ds(to_bf16_bits(streams)), dnw(to_bf16_bits(nw)), dy(size_t(128) * dim);
  DeviceBuffer<float> dpost(size_t(128) * kHc), dcomb(size_t(128) * kHc * kHc);
  auto run = [&](int t) {
    dy.fill_bytes(0xff);
    dpost.fill_bytes(0xff);
    dcomb.fill_bytes(0xff);
    cuda::HcPreParams p;
    p.shape = shape(dim);
    p.tokens = t;
    p.streams = bf16_ptr(ds);
    p.unit = du.params();
    p.norm = {bf16_ptr(dnw), 1e-6f};
    p.y = bf16_ptr(dy);
    p.post = dpost.data();
    p.comb = dcomb.data();
    p.path = cuda::HcPath::kSplit;
    cuda::hc_pre(p, nullptr);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  };
  run(tokens);
  const std::vector<uint16_t> y0 = dy.download();
  const std::vector<float> p0 = dpost.download(), c0 = dcomb.download();
  run(128);
  run(tokens);
  const std::vector<uint16_t> y1 = dy.download();
  const std::vector<float> p1 = dpost.download(), c1 = dcomb.download();
  const size_t ny = size_t(tokens) * dim, np = size_t(tokens) * kHc, nc = np * kHc;
  EXPECT_TRUE(std::equal(y0.begin(), y0.begin() + ny, y1.begin()));
  EXPECT_EQ(0, std::memcmp(p0.data(), p1.data(), np * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(c0.data(), c1.data(), nc * sizeof(float)));
}

// The engine's decode graphs: an eager mHC call on another path (the cluster kernel, forced) on a
// fresh stream reserves the split path's workspace, so a decode hc_post_pre captured next on that
// stream needs no allocation; the graph's replay (two PDL-chained kernels) gives the eager call's
// bits.
TEST_F(CudaMhc, SplitInsideGraphCapture) {
  Rng rng(900);
  const int dim = 4096, prefill = 300, tokens = 8;
  const Unit u = random_unit(rng, (2 + kHc) * kHc, dim, 3);
  const std::vector<float> big = random_streams(rng, prefill, dim);
  const std::vector<float> res = random_streams(rng, tokens, dim);
  const std::vector<float> x = random_bf16(rng, size_t(tokens) * dim, 1.0f);
  std::vector<float> post(size_t(tokens) * kHc), comb(size_t(tokens) * kHc * kHc);
  for (auto& v : post) v = float(rng.uniform(0.0, 2.0));
  for (auto& v : comb) v = float(rng.uniform(0.0, 1.0));
  std::vector<float> nw(dim);
  for (auto& v : nw) v = round_bf16(float(rng.uniform(0.5, 1.5)));
  const DevUnit du(u);
  DeviceBuffer<uint16_t> dbig(to_bf16_bits(big)), dybig(size_t(prefill) * dim);
  DeviceBuffer<float> dpbig(size_t(prefill) * kHc), dcbig(size_t(prefill) * kHc * kHc);
  DeviceBuffer<uint16_t> dres(to_bf16_bits(res)), dx(to_bf16_bits(x)), dnw(to_bf16_bits(nw));
  DeviceBuffer<uint16_t> dout(res.size()), dy(size_t(tokens) * dim);
  DeviceBuffer<float> dpost(post), dcomb(comb), dnpost(post.size()), dncomb(comb.size());
  cudaStream_t s;
  DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads ran on the legacy stream
  cuda::HcPreParams pre;
  pre.shape = shape(dim);
  pre.tokens = prefill;
  pre.streams = bf16_ptr(dbig);
  pre.unit = du.params();
  pre.y = bf16_ptr(dybig);
  pre.post = dpbig.data();
  pre.comb = dcbig.data();
  pre.path = cuda::HcPath::kCluster;
  cuda::hc_pre(pre, s);  // eager, cluster kernel: reserves the split path's workspace
  cuda::HcPostPreParams p;
  p.post.shape = shape(dim);
  p.post.tokens = tokens;
  p.post.x = bf16_ptr(dx);
  p.post.res = bf16_ptr(dres);
  p.post.post = dpost.data();
  p.post.comb = dcomb.data();
  p.post.out = bf16_ptr(dout);
  p.unit = du.params();
  p.norm = {bf16_ptr(dnw), 1e-6f};
  p.y = bf16_ptr(dy);
  p.next_post = dnpost.data();
  p.next_comb = dncomb.data();
  ASSERT_TRUE(cuda::mhc_cfg::uses_split_kernel(dim, tokens));
  cuda::hc_post_pre(p, s);
  DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
  const std::vector<uint16_t> out0 = dout.download(), y0 = dy.download();
  const std::vector<float> p0 = dnpost.download(), c0 = dncomb.download();
  dout.fill_bytes(0xff);
  dy.fill_bytes(0xff);
  dnpost.fill_bytes(0xff);
  dncomb.fill_bytes(0xff);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());  // the poison is in place before the replays
  cudaGraph_t g;
  cudaGraphExec_t e;
  DSV4_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  cuda::hc_post_pre(p, s);
  DSV4_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  DSV4_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  for (int i = 0; i < 3; ++i) DSV4_CUDA_CHECK(cudaGraphLaunch(e, s));
  DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_TRUE(dout.download() == out0);
  EXPECT_TRUE(dy.download() == y0);
  const std::vector<float> p1 = dnpost.download(), c1 = dncomb.download();
  EXPECT_EQ(0, std::memcmp(p0.data(), p1.data(), p0.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(c0.data(), c1.data(), c0.size() * sizeof(float)));
  DSV4_CUDA_CHECK(cudaGraphExecDestroy(e));
  DSV4_CUDA_CHECK(cudaGraphDestroy(g));
  DSV4_CUDA_CHECK(cudaStreamDestroy(s));
}

// The FP8 quantisation of y fused into hc_pre / hc_post_pre (FusedQuant): y bit-identical to the
// op without it, and the codes and scales byte-identical to quantize_act_fp8 of that y (itself
// byte-identical to cpu::quantize_fp8, gemm_test), pad rows of the scales included. Each path:
// the split-K finishing kernel quantises, the cluster and per-token paths launch the
// quantisation after the op.
void check_quant_fused(int dim, int tokens, bool post_pre, bool norm, cuda::HcPath path,
                       uint64_t seed) {
  Rng rng(seed);
  const PostPreInputs in = random_post_pre_inputs(rng, dim, tokens);
  const DevUnit du(in.u);
  DeviceBuffer<uint16_t> dnw(to_bf16_bits(in.nw)), dx(to_bf16_bits(in.x));
  DeviceBuffer<float> dpost(in.post), dcomb(in.comb);
  const __nv_bfloat16* norm_w = norm ? bf16_ptr(dnw) : nullptr;
  const int qld = cuda::fp8_scale_ld(tokens) + 4;  // rows past fp8_scale_ld stay untouched
  // Run 0 without, run 1 with the fused quantisation; each on fresh copies of the inputs.
  std::vector<uint16_t> y[2];
  DeviceBuffer<uint8_t> codes(size_t(tokens) * dim), want_codes(size_t(tokens) * dim);
  DeviceBuffer<float> st(size_t(dim / 128) * qld), want_st(size_t(dim / 128) * qld);
  codes.fill_bytes(0xee);
  want_codes.fill_bytes(0xee);
  st.fill_bytes(0xff);
  want_st.fill_bytes(0xff);
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer<uint16_t> dres(to_bf16_bits(in.res)), dy(size_t(tokens) * dim);
    DeviceBuffer<float> npost(in.post.size()), ncomb(in.comb.size());
    dy.fill_bytes(0xff);
    cuda::FusedQuant q;
    if (run == 1) q = {codes.data(), st.data(), qld};
    if (post_pre) {
      cuda::HcPostPreParams p = post_pre_params(
          dim, tokens, du.params(), bf16_ptr(dx), bf16_ptr(dres), dpost.data(), dcomb.data(),
          bf16_ptr(dres), norm_w, bf16_ptr(dy), npost.data(), ncomb.data(), path);
      p.quant = q;
      cuda::hc_post_pre(p, nullptr);
    } else {
      cuda::HcPreParams p = pre_params(dim, tokens, du.params(), bf16_ptr(dres), norm_w,
                                       bf16_ptr(dy), npost.data(), ncomb.data(), path);
      p.quant = q;
      cuda::hc_pre(p, nullptr);
    }
    if (run == 0) {
      cuda::ActQuantParams aq;
      aq.x = bf16_ptr(dy);
      aq.m = tokens;
      aq.k = dim;
      aq.codes = want_codes.data();
      aq.scales_t = want_st.data();
      aq.ld_scales = qld;
      cuda::quantize_act_fp8(aq, nullptr);
    }
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    y[run] = dy.download();
  }
  const std::string what = cat(post_pre ? "hc_post_pre" : "hc_pre", " + FP8 quant dim=", dim,
                               " tokens=", tokens, norm ? " +norm" : "", path_name(path));
  EXPECT_TRUE(y[0] == y[1]) << what << ": y changed by the fused quantisation";
  EXPECT_TRUE(codes.download() == want_codes.download()) << what << ": codes";
  const std::vector<float> got = st.download(), want = want_st.download();
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
      << what << ": scales (pad rows included)";
}

TEST_F(CudaMhc, FusedQuantOfY) {
  uint64_t seed = 700;
  using cuda::HcPath;
  // Flash / Pro widths at decode, speculative and prefill counts, each path; 8320: the per-token
  // kernel (above the split path's widths, no cluster tiling) under kAuto.
  for (HcPath path : {HcPath::kAuto, HcPath::kSplit, HcPath::kCluster})
    for (int dim : {4096, 7168})
      for (int tokens : {1, 3, 130}) {
        check_quant_fused(dim, tokens, false, true, path, seed++);
        check_quant_fused(dim, tokens, true, true, path, seed++);
      }
  check_quant_fused(4096, 2, true, false, HcPath::kSplit, seed++);  // no fused norm
  check_quant_fused(128, 5, false, true, HcPath::kSplit, seed++);   // one 128 block
  check_quant_fused(8320, 7, true, true, HcPath::kAuto, seed++);
  check_quant_fused(8320, 7, false, false, HcPath::kAuto, seed++);
}

TEST_F(CudaMhc, EmptyIsNoOp) {
  cuda::HcPreParams p;
  p.shape = shape(4096);
  p.tokens = 0;
  EXPECT_NO_THROW(cuda::hc_pre(p, nullptr));
}

// ---- host-side checks that need no GPU ---------------------------------------------------------

TEST(MhcApi, RejectsUnsupportedShapes) {
  cuda::HcPreParams p;
  p.shape = shape(4096);
  p.shape.hc = 2;
  p.tokens = 1;
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  p.shape = shape(100);  // not a multiple of 8
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  EXPECT_EQ(cuda::mhc_cfg::slice_dims(4096), 256);  // Flash: 16 CTAs
  EXPECT_EQ(cuda::mhc_cfg::slice_dims(7168), 512);  // Pro: 14 CTAs
  EXPECT_EQ(cuda::mhc_cfg::slice_dims(256), 256);
  EXPECT_EQ(cuda::mhc_cfg::slice_dims(200), 0);
  EXPECT_EQ(cuda::mhc_cfg::slice_dims(16384 + 512), 0);
}

// Which widths take which kernel, and what the API refuses before any launch (no GPU needed:
// every check precedes the first CUDA call).
TEST(MhcApi, PathPerWidth) {
  using namespace cuda::mhc_cfg;
  for (int dim : {256, 512, 1024, 4096, 7168, 8192}) EXPECT_TRUE(uses_cluster_kernel(dim)) << dim;
  for (int dim : {8, 128, 136, 384, 640, 4352, 8064, 8320, 16384})
    EXPECT_FALSE(uses_cluster_kernel(dim)) << dim;
  for (int dim : {8, 128, 384, 4096, 7168, 8192, 16384}) EXPECT_TRUE(supported_dim(dim)) << dim;
  for (int dim : {0, -128, 4, 100, 16384 + 8}) EXPECT_FALSE(supported_dim(dim)) << dim;
}

// Which token counts and widths take the split-K path, its grid, and what it refuses (host
// arithmetic and checks that precede every CUDA call).
TEST(MhcApi, SplitPathShapes) {
  using namespace cuda::mhc_cfg;
  for (int dim : {32, 384, 4096, 7168, 8192})
    for (int tokens : {1, 64, 128, 256}) EXPECT_TRUE(uses_split_kernel(dim, tokens)) << dim;
  EXPECT_TRUE(uses_split_kernel(4096, 512));   // b = 128 with a 3-token draft
  EXPECT_TRUE(uses_split_kernel(7168, 8192));  // prefill
  EXPECT_FALSE(uses_split_kernel(4096, 0));
  EXPECT_FALSE(uses_split_kernel(8192 + 32, 1));
  EXPECT_FALSE(uses_split_kernel(136, 1));  // not a multiple of 32
  // The grid covers every d-chunk and token once: each split owns >= 1 chunk, the last the rest.
  for (int sms : {1, 78, 132})
    for (int dim : {32, 96, 1056, 4096, 7168, 8192})
      for (int tokens : {1, 16, 17, 33, 64, 65, 128}) {
        const cuda::mhc_split::Geometry g = cuda::mhc_split::geometry(dim, tokens, sms);
        const int chunks = dim / kSplitDimUnit;
        EXPECT_GE(g.splits, 1);
        EXPECT_GE(g.splits * g.chunks_per_split, chunks) << dim << " " << tokens << " " << sms;
        EXPECT_LT((g.splits - 1) * g.chunks_per_split, chunks) << dim << " " << tokens;
        EXPECT_GE(g.tiles * g.rows, tokens);
        EXPECT_LT((g.tiles - 1) * g.rows, tokens);
      }
  // The reserved workspace holds the partials of every shape of up to 64 (2 SMs + 8) tokens.
  for (int sms : {1, 78, 132, 148})
    for (int dim = kSplitDimUnit; dim <= kSplitMaxDim; dim += kSplitDimUnit)
      for (int tokens = 1; size_t(tokens) <= cuda::mhc_split::reserved_partials(sms); ++tokens) {
        const cuda::mhc_split::Geometry g = cuda::mhc_split::geometry(dim, tokens, sms);
        ASSERT_LE(size_t(tokens) * g.splits, cuda::mhc_split::reserved_partials(sms))
            << dim << " " << tokens << " " << sms;
      }
  // The staged projection from kSplitStagedMinTokens, never for hc_post_pre (can_stage false).
  EXPECT_FALSE(cuda::mhc_split::geometry(4096, kSplitStagedMinTokens - 1, 132).staged);
  EXPECT_TRUE(cuda::mhc_split::geometry(4096, kSplitStagedMinTokens, 132).staged);
  EXPECT_TRUE(cuda::mhc_split::geometry(7168, 8192, 132).staged);
  EXPECT_FALSE(cuda::mhc_split::geometry(7168, 8192, 132, false).staged);
  EXPECT_EQ(cuda::mhc_split::geometry(4096, 8192, 132).rows, 16 * kSplitMaxMt);
  // Flash and Pro at one token on an H200 (132 SMs): one d-chunk per CTA.
  EXPECT_EQ(cuda::mhc_split::geometry(4096, 1, 132).splits, 128);
  EXPECT_EQ(cuda::mhc_split::geometry(7168, 1, 132).splits, 224);
  EXPECT_EQ(cuda::mhc_split::geometry(7168, 128, 132).rows, 64);
  for (int tokens : {513, 1000, 8192}) {  // forced at prefill sizes: tiles of 64, >= 1 chunk each
    const cuda::mhc_split::Geometry g = cuda::mhc_split::geometry(7168, tokens, 132);
    EXPECT_EQ(g.rows, 64);
    EXPECT_GE(g.splits * g.chunks_per_split, 224);
    EXPECT_LT((g.splits - 1) * g.chunks_per_split, 224);
    EXPECT_EQ(g.tiles, (tokens + 63) / 64);
  }
  // Forcing the split path on a width it does not take is refused before any launch.
  auto* fake_bf16 = reinterpret_cast<__nv_bfloat16*>(uintptr_t(256));
  auto* fake_f32 = reinterpret_cast<float*>(uintptr_t(512));
  cuda::HcPreParams p;
  p.streams = fake_bf16;
  p.unit = {fake_f32, fake_f32, fake_f32};
  p.y = fake_bf16;
  p.post = fake_f32;
  p.comb = fake_f32;
  p.path = cuda::HcPath::kSplit;
  p.tokens = 1;
  for (int dim : {136, 8192 + 32, 16384}) {
    p.shape = shape(dim);
    EXPECT_THROW(cuda::hc_pre(p, nullptr), Error) << dim;
  }
}

TEST(MhcApi, ValidatesInputs) {
  cuda::HcPreParams p;
  p.tokens = 1;
  for (int dim : {0, 100, 16384 + 8}) {
    p.shape = shape(dim);
    EXPECT_THROW(cuda::hc_pre(p, nullptr), Error) << dim;
  }
  p.shape = shape(128);
  p.tokens = -1;
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  p.tokens = 1;
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);  // null pointers
  p.shape.sinkhorn_iters = 0;
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  p.shape = shape(128);
  p.shape.hc_eps = std::nanf("");
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  p.shape = shape(384);
  p.shape.norm_eps = -1.0f;
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  cuda::HcHeadParams h;
  h.shape = shape(128);
  h.tokens = 2;
  EXPECT_THROW(cuda::hc_head(h, nullptr), Error);  // null pointers
  cuda::HcPostPreParams pp;
  pp.post.shape = shape(384);
  pp.post.tokens = 2;
  EXPECT_THROW(cuda::hc_post_pre(pp, nullptr), Error);  // null pointers
  cuda::HcPostParams q;
  q.shape = shape(128 + 4);
  q.tokens = 1;
  EXPECT_THROW(cuda::hc_post(q, nullptr), Error);  // not a multiple of 8
}

// The fused FP8 quantisation's arguments are refused before any launch (fake, aligned pointers:
// no CUDA call happens).
TEST(MhcApi, ValidatesFusedQuant) {
  auto* bf = reinterpret_cast<__nv_bfloat16*>(uintptr_t(1) << 20);
  auto* f32 = reinterpret_cast<float*>(uintptr_t(2) << 20);
  auto* u8 = reinterpret_cast<uint8_t*>(uintptr_t(3) << 20);
  cuda::HcPreParams p;
  p.tokens = 3;
  p.streams = bf;
  p.y = bf;
  p.post = f32;
  p.comb = f32;
  p.unit = {f32, f32, f32};
  p.shape = shape(4096 + 32);  // the split path takes it; the quantisation needs dim % 128 == 0
  p.quant = {u8, f32, 4};
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  p.shape = shape(4096);
  p.quant = {u8, nullptr, 4};  // codes without scales
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  p.quant = {u8, f32, 2};  // ld below the token count
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  p.quant = {u8, f32, 6};  // not a multiple of 4
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  p.quant = {u8 + 8, f32, 4};  // misaligned codes
  EXPECT_THROW(cuda::hc_pre(p, nullptr), Error);
  cuda::HcPostPreParams pp;
  pp.post.shape = shape(4096 + 32);
  pp.post.tokens = 3;
  pp.post.x = bf;
  pp.post.res = bf;
  pp.post.post = f32;
  pp.post.comb = f32;
  pp.post.out = bf;
  pp.unit = {f32, f32, f32};
  pp.y = bf;
  pp.next_post = f32;
  pp.next_comb = f32;
  pp.quant = {u8, f32, 4};
  EXPECT_THROW(cuda::hc_post_pre(pp, nullptr), Error);
}

}  // namespace
}  // namespace dsv4
