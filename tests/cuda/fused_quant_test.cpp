// Producers with the FP8 activation quantisation fused in (the launches they save: the
// quantize_act_fp8 before the q latent's wq_b / indexer wq_b and before the shared expert's w2):
//  * cuda::rms_norm with q_codes: y bit-identical to the plain rms_norm (and to cpu::rms_norm),
//    the codes and scales byte-identical to cpu::quantize_fp8 of y (what quantize_act_fp8
//    writes), the scale pad rows +0;
//  * glue::swiglu_fp8: its output bit-identical to glue::swiglu's, the codes and scales
//    byte-identical to cpu::quantize_fp8 of it;
//  * the attention's dense chain (quantise, grouped GEMM, fused q_norm, grouped GEMM,
//    q_norm_rope) launched programmatically: the same bytes eagerly and from a CUDA graph.
// Real widths (q_lora 1024 / 1536, shared inter 2048 / 3072) and edge ones (one 128 block, a
// half-idle warp, every RMSNorm thread-group size, 16384), 1..300 rows, row strides, in place,
// poisoned outputs. GPU tests skip without a GPU; the argument checks run anywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backends/cuda/glue.h"
#include "core/error.h"
#include "core/formats.h"
#include "core/rng.h"
#include "cuda/cuda_support.h"
#include "cuda/gpu_test.h"
#include "ops/cpu/norm.h"
#include "ops/cpu/quant.h"
#include "ops/cuda/attn_frontend/attn_frontend.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/gemm/fp8_gemm.h"
#include "ops/cuda/norm/norm.h"
#include "support/bf16_vectors.h"

namespace dsv4 {
namespace {

using cuda::DeviceBuffer;
using test::bf16_ptr;
using test::to_bf16_bits;

class CudaFusedQuant : public test::GpuTest {};

// Rows of BF16 values with a different magnitude per row and per 128 block, an all-zero row
// (the 1e-4 amax floor), a dominant element and a BF16 subnormal.
std::vector<float> random_rows(Rng& rng, int rows, int n, int64_t stride) {
  std::vector<float> x(size_t(rows) * stride, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const float row_mag = std::ldexp(1.0f, int(rng.below(16)) - 8);
    for (int b = 0; b < n / 128; ++b) {
      const float mag = row_mag * std::ldexp(1.0f, int(rng.below(6)) - 3);
      for (int i = 0; i < 128; ++i)
        x[size_t(r) * stride + b * 128 + i] = round_bf16(float(rng.normal()) * mag);
    }
  }
  if (rows > 2)
    for (int i = 0; i < n; ++i) x[size_t(2) * stride + i] = 0.0f;
  if (rows > 1) {
    x[size_t(1) * stride + 0] = round_bf16(6.0e4f);
    x[size_t(1) * stride + 1] = -bf16_to_float(0x0001);
  }
  return x;
}

// The codes [rows, k] and transposed scales [k/128, ld] a fused producer wrote against
// cpu::quantize_fp8 of its BF16 output y (dense [rows, k]); pad scale rows must be +0.
void expect_quant_of(const std::vector<float>& y, int rows, int k,
                     const std::vector<uint8_t>& codes, const std::vector<float>& scales_t, int ld,
                     const std::string& what) {
  const int kb = k / 128;
  std::vector<uint8_t> rc(size_t(rows) * k), re(size_t(rows) * kb);
  for (int r = 0; r < rows; ++r)
    cpu::quantize_fp8(y.data() + size_t(r) * k, k, 128, rc.data() + size_t(r) * k,
                      re.data() + size_t(r) * kb);
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < rc.size(); ++i)
    if (codes[i] != rc[i]) {
      if (first < 0) first = int64_t(i);
      ++bad;
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " codes differ; first [" << first / k << ", "
                    << first % k << "] got " << int(first >= 0 ? codes[first] : 0) << " want "
                    << int(first >= 0 ? rc[first] : 0);
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < kb; ++b)
      ASSERT_EQ(scales_t[size_t(b) * ld + r], e8m0_to_float(re[size_t(r) * kb + b]))
          << what << ": scale [" << r << ", " << b << "]";
  for (int b = 0; b < kb; ++b)
    for (int r = rows; r < (rows + 3) / 4 * 4; ++r) {
      uint32_t bits;
      std::memcpy(&bits, &scales_t[size_t(b) * ld + r], 4);
      ASSERT_EQ(bits, 0u) << what << ": pad scale [" << r << ", " << b << "]";
    }
}

// ---- RMSNorm + quantisation ----------------------------------------------------------------

void check_norm_quant(int rows, int n, int64_t ld, bool in_place, uint64_t seed) {
  Rng rng(seed);
  const int64_t stride = ld ? ld : n;
  const std::vector<float> x = random_rows(rng, rows, n, stride);
  std::vector<float> w(n);
  for (auto& v : w) v = round_bf16(float(rng.uniform(-2.0, 2.0)));
  const std::string what =
      cat("rms_norm+quant rows=", rows, " n=", n, " ld=", ld, in_place ? " in place" : "");

  DeviceBuffer<uint16_t> dw(to_bf16_bits(w));
  // The plain kernel's output: the reference for y.
  DeviceBuffer<uint16_t> dx_ref(to_bf16_bits(x)), dy_ref(size_t(rows) * stride);
  dy_ref.fill_bytes(0xff);
  cuda::RmsNormParams p;
  p.x = bf16_ptr(dx_ref);
  p.ldx = ld;
  p.rows = rows;
  p.n = n;
  p.weight = bf16_ptr(dw);
  p.eps = 1e-6f;
  p.y = bf16_ptr(dy_ref);
  p.ldy = ld;
  cuda::rms_norm(p, nullptr);

  DeviceBuffer<uint16_t> dx(to_bf16_bits(x)), dy(size_t(rows) * stride);
  dy.fill_bytes(0xff);
  const int qld = cuda::fp8_scale_ld(rows) + 4;  // a wider stride than needed is fine
  DeviceBuffer<uint8_t> codes(size_t(rows) * n);
  DeviceBuffer<float> st(size_t(n / 128) * qld);
  codes.fill_bytes(0xee);
  st.fill_bytes(0xff);
  p.x = bf16_ptr(dx);
  p.y = in_place ? bf16_ptr(dx) : bf16_ptr(dy);
  p.q_codes = codes.data();
  p.q_scales_t = st.data();
  p.q_ld_scales = qld;
  p.pdl = true;  // nothing to overlap here: the launch path with the attribute must work too
  cuda::rms_norm(p, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());

  const std::vector<uint16_t> want = dy_ref.download();
  const std::vector<uint16_t> got = in_place ? dx.download() : dy.download();
  std::vector<float> y(size_t(rows) * n), dense_x(size_t(rows) * n), cpu_y(size_t(rows) * n);
  int64_t bad = 0;
  for (int r = 0; r < rows; ++r)
    for (int64_t i = 0; i < stride; ++i) {
      const size_t e = size_t(r) * stride + i;
      if (i >= n) {
        if (!in_place) {
          EXPECT_EQ(got[e], 0xffff) << what << ": padding written";
        }
        continue;
      }
      bad += got[e] != want[e];
      y[size_t(r) * n + i] = bf16_to_float(got[e]);
      dense_x[size_t(r) * n + i] = x[e];
    }
  EXPECT_EQ(bad, 0) << what << ": y differs from the plain rms_norm";
  cpu::rms_norm(dense_x.data(), rows, n, w.data(), 1e-6f, cpu_y.data());
  for (size_t i = 0; i < y.size(); ++i)
    ASSERT_EQ(float_to_bf16(y[i]), float_to_bf16(cpu_y[i])) << what << ": y vs cpu at " << i;
  expect_quant_of(y, rows, n, codes.download(), st.download(), qld, what);
}

TEST_F(CudaFusedQuant, RmsNormQuantBytesMatch) {
  uint64_t seed = 10;
  // 128: one block, half of the warp idle; 1024 / 1536: Flash / Pro q_lora; 7168: groups of 128
  // threads; 16384: groups of 256.
  for (int n : {128, 384, 1024, 1536, 4096, 7168, 16384})
    for (int rows : {1, 3, 17, 64, 65}) check_norm_quant(rows, n, 0, false, seed++);
  check_norm_quant(300, 1024, 0, false, seed++);
  check_norm_quant(5, 1536, 1600, false, seed++);  // row strides
  check_norm_quant(7, 1024, 0, true, seed++);      // in place
}

// ---- SwiGLU + quantisation -----------------------------------------------------------------

void check_swiglu_quant(int rows, int inter, int64_t ld_gu, float limit, uint64_t seed) {
  Rng rng(seed);
  const int64_t ld = ld_gu ? ld_gu : 2 * inter;
  // g and u over a wide range, so that the clamps and exp's tails are exercised.
  std::vector<float> gu = random_rows(rng, rows, 2 * inter, ld);
  for (float& v : gu) v = round_bf16(v * 4.0f);
  const std::string what =
      cat("swiglu+quant rows=", rows, " inter=", inter, " ld=", ld, " limit=", limit);
  DeviceBuffer<uint16_t> dgu(to_bf16_bits(gu)), ref(size_t(rows) * inter),
      out(size_t(rows) * inter);
  ref.fill_bytes(0xff);
  out.fill_bytes(0xff);
  glue::swiglu(bf16_ptr(dgu), ld, rows, inter, limit, bf16_ptr(ref), nullptr);
  const int qld = cuda::fp8_scale_ld(rows);
  DeviceBuffer<uint8_t> codes(size_t(rows) * inter);
  DeviceBuffer<float> st(size_t(inter / 128) * qld);
  codes.fill_bytes(0xee);
  st.fill_bytes(0xff);
  glue::SwigluFp8Params p;
  p.gu = bf16_ptr(dgu);
  p.ld_gu = ld;
  p.rows = rows;
  p.inter = inter;
  p.limit = limit;
  p.out = bf16_ptr(out);
  p.codes = codes.data();
  p.scales_t = st.data();
  p.ld_scales = qld;
  p.pdl = true;
  glue::swiglu_fp8(p, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> want = ref.download(), got = out.download();
  ASSERT_TRUE(got == want) << what << ": output differs from glue::swiglu";
  std::vector<float> y(got.size());
  for (size_t i = 0; i < y.size(); ++i) y[i] = bf16_to_float(got[i]);
  expect_quant_of(y, rows, inter, codes.download(), st.download(), qld, what);
}

TEST_F(CudaFusedQuant, SwigluQuantBytesMatch) {
  uint64_t seed = 100;
  for (int inter : {128, 384, 2048, 3072})
    for (int rows : {1, 3, 17, 64, 65, 257})
      for (float limit : {0.0f, 10.0f}) check_swiglu_quant(rows, inter, 0, limit, seed++);
  check_swiglu_quant(5, 2048, 2 * 2048 + 64, 10.0f, seed++);  // a wider gu row
}

// ---- the attention's dense chain, programmatically launched, in a CUDA graph -------------------

// x -> quantize_act_fp8 -> grouped [wq_a; wkv] -> rms_norm of q with its quantisation fused ->
// grouped [wq_b; indexer wq_b] -> q_norm_rope in place: every launch after the first with
// programmatic dependent launch (as the engine chains them).
struct ChainOut {
  std::vector<uint16_t> qr, kv, qr_n, q, qi;
};

// How two outputs differ: the count, how many of `got` are still poison (0xffff), the first.
std::string differing(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  if (got.size() != want.size()) return cat(" (sizes ", got.size(), " vs ", want.size(), ")");
  int64_t n = 0, poisoned = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      ++n;
      poisoned += got[i] == 0xffff;
      if (first < 0) first = int64_t(i);
    }
  if (n == 0) return "";
  return cat(" (", n, " of ", got.size(), " differ, ", poisoned, " still poison; first at ", first,
             ": ", got[first], " vs ", want[first], ")");
}

struct Chain {
  static constexpr int kDim = 1024, kQl = 512, kKv = 256, kQ = 2048, kQi = 640;
  int m;
  DeviceBuffer<uint16_t> x, qr, kv, qr_n, q, qi, norm_w;
  DeviceBuffer<uint8_t> codes0, codes1;
  DeviceBuffer<float> scales0, scales1, cos_sin;
  struct W {
    DeviceBuffer<uint8_t> codes;
    DeviceBuffer<float> scales_t;
    int n, k;
  };
  std::vector<W> w;

  Chain(int m_, Rng& rng)
      : m(m_),
        x(to_bf16_bits(random_rows(rng, m_, kDim, kDim))),
        qr(size_t(m_) * kQl),
        kv(size_t(m_) * kKv),
        qr_n(size_t(m_) * kQl),
        q(size_t(m_) * kQ),
        qi(size_t(m_) * kQi),
        norm_w(size_t(kQl)),
        codes0(size_t(m_) * kDim),
        codes1(size_t(m_) * kQl),
        scales0(size_t(kDim / 128) * cuda::fp8_scale_ld(m_)),
        scales1(size_t(kQl / 128) * cuda::fp8_scale_ld(m_)),
        cos_sin(size_t(m_) * 64) {
    std::vector<float> cs(cos_sin.size());
    for (size_t i = 0; i < cs.size(); i += 2) {
      const double a = rng.uniform(-3.0, 3.0);
      cs[i] = float(std::cos(a));
      cs[i + 1] = float(std::sin(a));
    }
    cos_sin.upload(cs);
    std::vector<float> nw(kQl);
    for (auto& v : nw) v = round_bf16(float(rng.uniform(0.5, 1.5)));
    norm_w.upload(to_bf16_bits(nw));
    const int shapes[4][2] = {{kQl, kDim}, {kKv, kDim}, {kQ, kQl}, {kQi, kQl}};
    for (const auto& sh : shapes) {
      W ww{DeviceBuffer<uint8_t>(size_t(sh[0]) * sh[1]),
           DeviceBuffer<float>(size_t(sh[1] / 128) * ((sh[0] + 127) / 128)), sh[0], sh[1]};
      std::vector<uint8_t> c(size_t(sh[0]) * sh[1]);
      for (auto& b : c) {
        b = uint8_t(rng.below(256));
        if ((b & 0x7f) == 0x7f) b ^= 1;  // no e4m3 NaN codes
      }
      ww.codes.upload(c);
      std::vector<float> sc(ww.scales_t.size());
      for (auto& v : sc) v = std::ldexp(1.0f, int(rng.below(5)) - 8);
      ww.scales_t.upload(sc);
      w.push_back(std::move(ww));
    }
  }

  void run(cudaStream_t st) {
    cuda::ActQuantParams qp;
    qp.x = bf16_ptr(x);
    qp.m = m;
    qp.k = kDim;
    qp.codes = codes0.data();
    qp.scales_t = scales0.data();
    qp.ld_scales = cuda::fp8_scale_ld(m);
    cuda::quantize_act_fp8(qp, st);
    grouped(codes0.data(), scales0.data(), 0, bf16_ptr(qr), bf16_ptr(kv), st);
    cuda::RmsNormParams rn;
    rn.x = bf16_ptr(qr);
    rn.rows = m;
    rn.n = kQl;
    rn.weight = bf16_ptr(norm_w);
    rn.y = bf16_ptr(qr_n);
    rn.q_codes = codes1.data();
    rn.q_scales_t = scales1.data();
    rn.q_ld_scales = cuda::fp8_scale_ld(m);
    rn.pdl = true;
    cuda::rms_norm(rn, st);
    grouped(codes1.data(), scales1.data(), 2, bf16_ptr(q), bf16_ptr(qi), st);
    cuda::QNormRopeParams qn;
    qn.q = bf16_ptr(q);
    qn.out = bf16_ptr(q);
    qn.cos_sin = reinterpret_cast<const float2*>(cos_sin.data());
    qn.num_tokens = m;
    qn.num_heads = kQ / 512;
    qn.pdl = true;
    cuda::q_norm_rope(qn, st);
  }
  void grouped(const uint8_t* codes, const float* scales, int w0, __nv_bfloat16* y0,
               __nv_bfloat16* y1, cudaStream_t st) {
    cuda::Fp8GemmGroupedParams g;
    g.a_codes = codes;
    g.a_scales_t = scales;
    g.a_ld_scales = cuda::fp8_scale_ld(m);
    g.m = m;
    g.count = 2;
    for (int i = 0; i < 2; ++i)
      g.w[i] = {w[w0 + i].codes.data(), w[w0 + i].scales_t.data(), w[w0 + i].n, w[w0 + i].k};
    g.y[0] = y0;
    g.y[1] = y1;
    g.pdl = true;
    cuda::fp8_gemm_grouped(g, st);
  }
  // fill_bytes(byte) returns once the fill is done, so the chain on its non-blocking stream
  // cannot overtake it.
  void poison() {
    for (auto* b : {&qr, &kv, &qr_n, &q, &qi}) b->fill_bytes(0xff);
    codes1.fill_bytes(0xee);
    scales1.fill_bytes(0xff);
  }
  ChainOut out() {
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    return {qr.download(), kv.download(), qr_n.download(), q.download(), qi.download()};
  }
};

TEST_F(CudaFusedQuant, PdlChainInAGraphEqualsEager) {
  // The programmatically launched chain gives the same bytes eagerly, captured in a CUDA graph
  // and replayed twice (outputs poisoned before each run); the streaming path's widths.
  Rng rng(500);
  for (int m : {1, 5, 64}) {
    Chain c(m, rng);
    cudaStream_t st;
    DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    c.poison();
    c.run(st);  // eager (also the warm-up: kernel attributes are set outside the capture)
    DSV4_CUDA_CHECK(cudaStreamSynchronize(st));
    const ChainOut eager = c.out();
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    DSV4_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    c.run(st);
    DSV4_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    DSV4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; ++rep) {
      c.poison();
      DSV4_CUDA_CHECK(cudaGraphLaunch(exec, st));
      DSV4_CUDA_CHECK(cudaStreamSynchronize(st));
      const ChainOut g = c.out();
      EXPECT_TRUE(g.qr == eager.qr && g.kv == eager.kv)
          << "m=" << m << " rep " << rep << ": wq_a/wkv";
      EXPECT_TRUE(g.qr_n == eager.qr_n) << "m=" << m << " rep " << rep << ": q_norm";
      EXPECT_TRUE(g.q == eager.q) << "m=" << m << " rep " << rep << ": wq_b + q_norm_rope (q)"
                                  << differing(g.q, eager.q);
      EXPECT_TRUE(g.qi == eager.qi)
          << "m=" << m << " rep " << rep << ": indexer wq_b (qi)" << differing(g.qi, eager.qi);
    }
    // Nothing left poisoned: every output was written.
    for (const auto* v : {&eager.qr, &eager.kv, &eager.qr_n, &eager.q, &eager.qi}) {
      int64_t poisoned = 0;
      for (uint16_t b : *v) poisoned += b == 0xffff;
      EXPECT_EQ(poisoned, 0) << "m=" << m;
    }
    DSV4_CUDA_CHECK(cudaGraphExecDestroy(exec));
    DSV4_CUDA_CHECK(cudaGraphDestroy(graph));
    DSV4_CUDA_CHECK(cudaStreamDestroy(st));
  }
}

// ---- argument checks (no GPU) ------------------------------------------------------------------

TEST(FusedQuantApi, RejectsBadShapes) {
  // Plausible aligned addresses: the checks run before anything touches them.
  auto* b = reinterpret_cast<__nv_bfloat16*>(uintptr_t(1) << 20);
  auto* codes = reinterpret_cast<uint8_t*>(uintptr_t(2) << 20);
  auto* scales = reinterpret_cast<float*>(uintptr_t(3) << 20);
  cuda::RmsNormParams r;
  r.x = b;
  r.y = b;
  r.weight = b;
  r.rows = 4;
  r.n = 136;  // fine for the plain norm, not a whole number of quantisation blocks
  r.q_codes = codes;
  r.q_scales_t = scales;
  r.q_ld_scales = 4;
  EXPECT_THROW(cuda::rms_norm(r, nullptr), Error);
  r.n = 256;
  r.q_ld_scales = 2;  // below the rows
  EXPECT_THROW(cuda::rms_norm(r, nullptr), Error);
  r.q_ld_scales = 4;
  r.q_scales_t = nullptr;
  EXPECT_THROW(cuda::rms_norm(r, nullptr), Error);

  glue::SwigluFp8Params s;
  s.gu = b;
  s.out = b;
  s.codes = codes;
  s.scales_t = scales;
  s.rows = 4;
  s.inter = 192;  // not a multiple of 128
  s.ld_gu = 384;
  s.ld_scales = 4;
  EXPECT_THROW(glue::swiglu_fp8(s, nullptr), Error);
  s.inter = 256;
  s.ld_gu = 384;  // < 2 inter
  EXPECT_THROW(glue::swiglu_fp8(s, nullptr), Error);
  s.ld_gu = 512;
  s.ld_scales = 6;  // not a multiple of 4
  EXPECT_THROW(glue::swiglu_fp8(s, nullptr), Error);
}

}  // namespace
}  // namespace dsv4
