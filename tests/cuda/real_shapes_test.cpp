// Kernels at the real V4-Flash / V4-Pro shapes the other GPU tests do not reach, each against its
// CPU op on fresh random inputs with poisoned outputs (issue 14, point 7):
//
// RealShapeMoe.*  moe_forward with every routed expert of a real layer -- Flash: 256 experts,
//   dim 4096, inter 2048; Pro: 384, dim 7168, inter 3072; top-6 -- at M >= 128 (the batch-128
//   decode step and beyond), MXFP4 and NVFP4, score and hash routing (Flash: both formats and
//   routings, M 128 and 512; Pro: NVFP4 score routing at M 128, the costliest CPU reference). Every
//   stage as moe_test judges it (router selections in order and weights bit-exact; x and
//   activation quantisation bytes identical; the grouping and tiles; gate/up + SwiGLU and the layer
//   output within moe_test's tolerance: relative L2 <= 4e-3, >= 99 % within one BF16 ulp, gate/up
//   also no element beyond 4 ulps of the largest), and the down GEMM per element within its derived
//   bound (ops/cpu/error_bound.h: BF16 MMA sums, kBf16Mma) from the GPU's own quantised
//   activations (every expert at Flash M 128, every 2nd at M 512, every 4th at Pro size: the
//   bound costs ~30x the GEMM on the CPU), besides the tolerance on every expert; the combine
//   bit-exact. The CPU reference is cpu::moe_forward's computation, run expert by expert
//   (cpu::expert_forward over the expert's rows, then cpu::moe_combine): the same arithmetic, with
//   each expert's weights dequantised only while it is used (all experts at once would take ~100 GB
//   of host memory at Pro size), on all cores.
// RealShapeFp8Gemm.*  the tensor-core FP8 GEMM (m > 64: CUTLASS blockwise) at prefill shapes:
//   8192 rows (a prefill chunk) x every dense FP8 linear of Flash and Pro, and 200 rows (the
//   65-256 range) on a few. The GPU computes all rows; the CPU checks a sample of rows (the
//   first and last 128-row tiles and rows spread between; rows are independent in both), each
//   element within the derived bound of the blockwise FP8 wgmma sums (kFp8WgmmaBlock) and the
//   sample within gemm_test's tolerance (relative L2 <= 4e-3, >= 99 % within one ulp).
//
// Run time on the H200 machine (16 cores): about 3-4 minutes (estimated from the CPU references'
// cost on a slower machine), most of it the CPU references; CTest allows 900 s.
// Host memory: up to ~25 GB (the Pro experts' checkpoint bytes plus the per-thread dequantised
// experts). Skips (exit 77) without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/formats.h"
#include "core/rng.h"
#include "cuda/cuda_support.h"
#include "cuda/gpu_test.h"
#include "model/weight_quant.h"
#include "ops/cpu/dequant.h"
#include "ops/cpu/error_bound.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/quant.h"
#include "ops/cuda/common/device.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/gemm/fp8_gemm.h"
#include "ops/cuda/moe/moe.h"
#include "support/bf16_compare.h"
#include "support/bf16_vectors.h"
#include "support/fp8_data.h"
#include "support/host_tensors.h"
#include "support/random_values.h"

namespace dsv4 {
namespace {

namespace cm = cuda::moe;
using test::as_bytes;
using test::fetch;
using test::fetch_bf16;
using test::from_bf16_bits;
using test::gaussian;
using test::HostTensors;
using test::to_bf16_bits;

int workers() {
  return std::max(1, std::min(16, int(std::thread::hardware_concurrency())));
}

// Runs f(i) for i in [0, n) on all cores.
template <typename F>
void parallel_for(int n, F f) {
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < std::min(n, workers()); ++t)
    pool.emplace_back([&] {
      for (int i = next++; i < n; i = next++) f(i);
    });
  for (std::thread& t : pool) t.join();
}

// The largest |got - want| in BF16 ulps of max |want|, the relative L2 and the share within one
// ulp (moe_test's expect_close).
void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what,
                  const std::vector<char>* skip_rows = nullptr, size_t row_len = 1,
                  int max_ulps_of_max = 0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double num = 0, den = 0, worst = 0, max_ref = 0;
  size_t n = 0, ok = 0, worst_i = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (skip_rows && (*skip_rows)[i / row_len]) continue;
    ++n;
    const double d = double(got[i]) - want[i];
    num += d * d;
    den += double(want[i]) * want[i];
    ok += std::fabs(d) <= test::bf16_ulp(std::max(std::fabs(got[i]), std::fabs(want[i])));
    const double e = std::isfinite(d) ? std::fabs(d) : 1e300;
    if (e > worst) worst = e, worst_i = i;
    max_ref = std::max(max_ref, double(std::fabs(want[i])));
  }
  double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (!std::isfinite(rel)) rel = 1e300;
  const double within = n ? double(ok) / double(n) : 1;
  const std::string msg =
      cat(what, ": n ", n, ", rel L2 ", rel, ", within 1 ulp ", 100 * within, " %, worst [",
          worst_i, "] gpu ", got[worst_i], " cpu ", want[worst_i], " (max |cpu| ", max_ref, ")");
  EXPECT_LE(rel, 4e-3) << msg;
  EXPECT_GE(within, 0.99) << msg;
  if (max_ulps_of_max > 0) {
    EXPECT_LE(worst, max_ulps_of_max * test::bf16_ulp(float(max_ref))) << msg;
  }
  std::printf("  %s\n", msg.c_str());
}

void expect_bits_equal(const std::vector<float>& got, const std::vector<float>& want,
                       const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (float_to_bf16(got[i]) != float_to_bf16(want[i]) && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << want.size() << " differ; first [" << first
                     << "] gpu " << (bad ? got[first] : 0) << " cpu " << (bad ? want[first] : 0);
}

void expect_within_bounds(const std::vector<float>& got, const std::vector<float>& want,
                          const std::vector<float>& bound, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const cpu::BoundCheck c =
      cpu::check_bounds(got.data(), want.data(), bound.data(), want.size(), cpu::Rounding::kBf16);
  const size_t w = c.worst;
  const std::string msg = cat(what, ": ", c.n, " elements, ", c.beyond,
                              " beyond their derived bound; worst [", w, "] gpu ", got[w], " cpu ",
                              want[w], " at ", c.worst_ratio, " of its tolerance ", c.worst_tol);
  EXPECT_TRUE(c.ok()) << msg << (c.nan_mismatch ? " (a NaN on one side)" : "")
                      << (c.first_bad != SIZE_MAX ? cat("; first beyond: [", c.first_bad, "]")
                                                  : std::string());
  std::printf("  %s\n", msg.c_str());
}

// ---- RealShapeMoe ---------------------------------------------------------------------------

struct MoeSpec {
  std::string name;
  int dim, inter, E, K;
  ExpertFormat fmt;
  bool hash;
  int m;
  int bound_every = 1;  // the down GEMM's derived bound on experts e % bound_every == 0 (its CPU
                        // cost is ~30x the GEMM's; the tolerance check covers every expert)
  cm::MoeGemmPath path = cm::MoeGemmPath::kAuto;  // expert GEMM path (kAuto: the heuristic)
};
std::ostream& operator<<(std::ostream& os, const MoeSpec& s) {
  return os << s.name;
}

constexpr int kVocab = 1000;
constexpr float kRouteScale = 1.5f, kLimit = 10.0f;

// Random bytes (xorshift64*), 8 at a time: gigabytes of expert codes in seconds.
void random_fill(std::vector<uint8_t>& v, uint64_t seed, uint8_t lo = 0, uint8_t span = 0) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < v.size(); i += 8) {
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    const uint64_t r = s * 0x2545f4914f6cdd1dull;
    for (size_t j = 0; j < 8 && i + j < v.size(); ++j) {
      const uint8_t b = uint8_t(r >> (8 * j));
      v[i + j] = span ? uint8_t(lo + b % span) : b;
    }
  }
}

// One FP4 projection [out, in] with codes and scales drawn directly (moe_test's large-shape
// path): weights of standard deviation ~w_std.
struct Fp4Bytes {
  std::vector<uint8_t> codes, scales;
  float scale_2 = 0;  // NVFP4
};
Fp4Bytes draw_fp4(ExpertFormat f, int out, int in, float w_std, uint64_t seed) {
  Fp4Bytes b;
  b.codes.resize(size_t(out) * in / 2);
  random_fill(b.codes, seed);
  const float s = w_std / 2.93f;  // uniform e2m1 codes have std ~2.93
  if (f == ExpertFormat::kMxfp4) {
    b.scales.resize(size_t(out) * in / 32);
    random_fill(b.scales, seed + 1, uint8_t(127 + int(std::lround(std::log2(s))) - 1), 3);
  } else {
    b.scales.resize(size_t(out) * in / 16);
    random_fill(b.scales, seed + 1, 0x38, 13);  // E4M3 1.0 .. 2.5
    b.scale_2 = s / 1.7f * 1.1371f;
  }
  return b;
}
Fp4Ref add_fp4(HostTensors& h, const std::string& name, ExpertFormat f, int out, int in,
               Fp4Bytes&& b) {
  Fp4Ref r;
  r.format = f;
  r.weight = h.add(name + ".weight", DType::kU8, {out, in / 2}, std::move(b.codes));
  if (f == ExpertFormat::kMxfp4) {
    r.scale = h.add(name + ".scale", DType::kF8E8M0, {out, in / 32}, std::move(b.scales));
  } else {
    r.scale = h.add(name + ".weight_scale", DType::kF8E4M3, {out, in / 16}, std::move(b.scales));
    r.scale_2 =
        h.add(name + ".weight_scale_2", DType::kF32, {}, as_bytes(std::vector<float>{b.scale_2}));
  }
  return r;
}

struct MoeLayer {
  HostTensors h;
  MoeRef ref;
  cpu::MoeWeights cpu;  // router only: experts are dequantised one at a time (expert_weights)
  cpu::MoeParams p;
  cm::MoeDeviceWeights dev;
};

cpu::ExpertWeights expert_weights(const ExpertRef& x) {
  auto lin = [](const Fp4Ref& r) {
    return cpu::Linear::from_rows(cpu::LinearKind::kFp4, int(r.weight->shape[0]),
                                  int(r.weight->shape[1] * 2), cpu::dequant_fp4(r));
  };
  return {lin(x.w1), lin(x.w2), lin(x.w3)};
}

std::unique_ptr<MoeLayer> make_moe_layer(const MoeSpec& s, uint32_t seed) {
  auto L = std::make_unique<MoeLayer>();
  std::mt19937 rng(seed);
  const int dim = s.dim, inter = s.inter, E = s.E;
  const std::vector<float> gate = gaussian(size_t(E) * dim, 1.0f / std::sqrt(float(dim)), rng);
  L->ref.gate = L->h.add("gate", DType::kBF16, {E, dim}, as_bytes(to_bf16_bits(gate)));
  L->cpu.gate = cpu::Linear::from_rows(cpu::LinearKind::kF32, E, dim, gate);
  if (s.hash) {
    // k distinct experts per token, except every 7th token listing one expert twice (the
    // reference applies it once).
    std::vector<int32_t> ids(size_t(kVocab) * s.K);
    for (int t = 0; t < kVocab; ++t) {
      std::set<int> used;
      for (int i = 0; i < s.K; ++i) {
        int e;
        do e = int(rng() % E);
        while (used.count(e));
        used.insert(e);
        ids[size_t(t) * s.K + i] = e;
      }
      if (t % 7 == 0) ids[size_t(t) * s.K + 1] = ids[size_t(t) * s.K];
    }
    L->ref.tid2eid = L->h.add("tid2eid", DType::kI32, {kVocab, s.K}, as_bytes(ids));
    L->cpu.tid2eid = ids;
  } else {
    const std::vector<float> bias = gaussian(E, 0.05f, rng, false);
    L->ref.bias = L->h.add("bias", DType::kF32, {E}, as_bytes(bias));
    L->cpu.bias = bias;
  }
  // Every expert its own weights (a kernel reading another expert's would be caught), drawn
  // on all cores.
  const float s13 = 4.0f / std::sqrt(float(dim)), s2 = 0.2f / std::sqrt(float(inter));
  std::vector<std::array<Fp4Bytes, 3>> drawn(static_cast<size_t>(E));
  parallel_for(E, [&](int e) {
    const uint64_t es = uint64_t(seed) * 1000003ull + uint64_t(e) * 16;
    drawn[size_t(e)][0] = draw_fp4(s.fmt, inter, dim, s13, es);
    drawn[size_t(e)][1] = draw_fp4(s.fmt, inter, dim, s13, es + 4);
    drawn[size_t(e)][2] = draw_fp4(s.fmt, dim, inter, s2, es + 8);
  });
  for (int e = 0; e < E; ++e) {
    const std::string p = "experts." + std::to_string(e) + ".";
    ExpertRef x;
    x.w1 = add_fp4(L->h, p + "w1", s.fmt, inter, dim, std::move(drawn[size_t(e)][0]));
    x.w3 = add_fp4(L->h, p + "w3", s.fmt, inter, dim, std::move(drawn[size_t(e)][1]));
    x.w2 = add_fp4(L->h, p + "w2", s.fmt, dim, inter, std::move(drawn[size_t(e)][2]));
    L->ref.experts.push_back(x);
  }
  L->p = {s.K, ScoreFunc::kSqrtSoftplus, kRouteScale, kLimit};
  L->dev = cm::upload_moe_weights(L->ref);
  return L;
}

struct GpuMoe {
  int pairs = 0, tiles = 0, flags = 0, tile_n = 0;
  std::vector<float> y, xq, act, actq, ye, wt, sorted_wt;
  std::vector<int32_t> sel, pair_pos, sorted_row, expert_first, tiles4;
};

GpuMoe run_gpu_moe(const MoeLayer& L, const MoeSpec& s, const std::vector<float>& x,
                   const std::vector<int32_t>& tokens, const std::vector<float>& shared) {
  const int m = s.m, dim = s.dim, K = s.K;
  cuda::DeviceBuffer<uint16_t> dx(to_bf16_bits(x)), dsh(to_bf16_bits(shared)), dy(size_t(m) * dim);
  cuda::DeviceBuffer<int32_t> dtok(tokens);
  const size_t bytes = cm::moe_workspace_bytes(L.dev, m, K);
  cuda::DeviceBuffer<uint8_t> ws(bytes);
  ws.fill_bytes(0xff);  // poison: NaN BF16/fp32, -1 ints
  dy.fill_bytes(0xff);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t stream;
  DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cm::MoeArgs a;
  a.x = reinterpret_cast<const __nv_bfloat16*>(dx.data());
  a.tokens = s.hash ? dtok.data() : nullptr;
  a.shared = reinterpret_cast<const __nv_bfloat16*>(dsh.data());
  a.y = reinterpret_cast<__nv_bfloat16*>(dy.data());
  a.m = m;
  a.p = {s.K, ScoreFunc::kSqrtSoftplus, kRouteScale, kLimit};
  a.workspace = ws.data();
  a.workspace_bytes = bytes;
  a.stream = stream;
  a.gemm_path = s.path;
  cm::moe_forward(L.dev, a);
  DSV4_CUDA_CHECK(cudaGetLastError());
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
  DSV4_CUDA_CHECK(cudaStreamDestroy(stream));
  const cm::MoeWorkspace w = cm::carve_moe_workspace(L.dev, m, K, ws.data());
  GpuMoe o;
  o.tile_n = cm::moe_gemm_choice(L.dev, m, K, s.path).tile_n;
  const std::vector<int32_t> cnt = fetch(w.counters, 3);
  o.pairs = cnt[0], o.tiles = cnt[1], o.flags = cnt[2];
  const size_t P = size_t(std::clamp(o.pairs, 0, m * K));
  o.y = from_bf16_bits(dy.download());
  o.xq = fetch_bf16(w.xq, size_t(m) * dim);
  o.sel = fetch(w.sel, size_t(m) * K);
  o.wt = fetch(w.wt, size_t(m) * K);
  o.pair_pos = fetch(w.pair_pos, size_t(m) * K);
  o.sorted_row = fetch(w.sorted_row, P);
  o.sorted_wt = fetch(w.sorted_wt, P);
  o.expert_first = fetch(w.expert_first, size_t(s.E) + 1);
  o.tiles4 =
      fetch(reinterpret_cast<const int32_t*>(w.tiles), 4 * size_t(std::clamp(o.tiles, 0, m * K)));
  o.act = fetch_bf16(w.act, P * s.inter);
  o.actq = fetch_bf16(w.actq, P * s.inter);
  o.ye = fetch_bf16(w.ye, P * dim);
  return o;
}

class RealShapeMoe : public ::testing::TestWithParam<MoeSpec> {
 protected:
  void SetUp() override { DSV4_SKIP_WITHOUT_GPU(); }
};

TEST_P(RealShapeMoe, StagesMatchCpu) {
  const MoeSpec& s = GetParam();
  const uint32_t seed = 4242 + uint32_t(s.m) + uint32_t(s.E);
  auto L = make_moe_layer(s, seed);
  std::mt19937 rng(seed + 1);
  const int m = s.m, dim = s.dim, K = s.K, E = s.E, inter = s.inter;
  const std::vector<float> x = gaussian(size_t(m) * dim, 1.0f, rng);
  std::vector<int32_t> tokens(m);
  for (int r = 0; r < m; ++r) tokens[r] = int(rng() % kVocab);
  const std::vector<float> shared = gaussian(size_t(m) * dim, 0.05f, rng);

  const GpuMoe g = run_gpu_moe(*L, s, x, tokens, shared);
  std::printf("[%s] m %d, %s GEMM, tile_n %d, unique pairs %d, tiles %d\n", s.name.c_str(), m,
              cm::moe_gemm_path_name(cm::moe_gemm_choice(L->dev, m, K, s.path).path), g.tile_n,
              g.pairs, g.tiles);
  EXPECT_EQ(g.flags, 0) << "device error flags";

  // Routing: the CPU router per row, exactly -- the selected experts in selection order and the
  // weights bit for bit. The GPU router adds the exact BF16 x BF16 products in fp64 (in another
  // order than cpu::linear) and rounds once to fp32, then computes the score with every fp32
  // operation correctly rounded (as the CPU does): a logit can differ only where the two fp64
  // sums straddle an fp32 rounding boundary (~1e-7 per logit), so a mismatch here is a bug
  // (moe_test's expect_route holds the same at these shapes).
  std::vector<int32_t> csel(size_t(m) * K);
  std::vector<float> cwt(size_t(m) * K);
  int bad_rows = 0;
  for (int r = 0; r < m; ++r) {
    int32_t* cs = csel.data() + size_t(r) * K;
    float* cw = cwt.data() + size_t(r) * K;
    cpu::moe_route(L->cpu, L->p, x.data() + size_t(r) * dim, tokens[r], cs, cw);
    for (int i = 0; i < K; ++i) {
      const size_t j = size_t(r) * K + i;
      uint32_t gb, cb;
      std::memcpy(&gb, &g.wt[j], 4);
      std::memcpy(&cb, &cw[i], 4);
      if (g.sel[j] != cs[i] || gb != cb) {
        if (bad_rows++ < 5)
          ADD_FAILURE() << (s.hash ? "hash" : "score") << " routing, row " << r << " slot " << i
                        << ": gpu expert " << g.sel[j] << " weight " << g.wt[j] << ", cpu expert "
                        << cs[i] << " weight " << cw[i];
        break;
      }
    }
  }
  ASSERT_EQ(bad_rows, 0) << "rows routed differently from cpu::moe_route";

  // x quantisation: bytes identical.
  std::vector<float> xq_ref(x.size());
  for (int r = 0; r < m; ++r)
    cpu::fake_quant_fp8(x.data() + size_t(r) * dim, dim, 128, xq_ref.data() + size_t(r) * dim);
  expect_bits_equal(g.xq, xq_ref, "x quantisation");

  // Grouping: unique pairs, per-expert ranges, the pair -> position map, tiles covering each
  // position once.
  std::vector<int> cnt(E, 0);
  int pairs = 0;
  for (int r = 0; r < m; ++r)
    for (int i = 0; i < K; ++i) {
      const int e = g.sel[size_t(r) * K + i];
      bool dup = false;
      for (int j = 0; j < i; ++j) dup |= g.sel[size_t(r) * K + j] == e;
      const int pos = g.pair_pos[size_t(r) * K + i];
      if (dup) {
        EXPECT_EQ(pos, -1) << "row " << r << " slot " << i << " repeats expert " << e;
        continue;
      }
      ++cnt[e], ++pairs;
      ASSERT_TRUE(pos >= 0 && pos < g.pairs) << "row " << r << " slot " << i << " pos " << pos;
      EXPECT_EQ(g.sorted_row[pos], r);
      EXPECT_TRUE(pos >= g.expert_first[e] && pos < g.expert_first[e + 1]) << "pos " << pos;
      EXPECT_EQ(g.sorted_wt[pos], g.wt[size_t(r) * K + i]);
    }
  ASSERT_EQ(g.pairs, pairs);
  int want_tiles = 0, active = 0;
  for (int e = 0; e < E; ++e) {
    ASSERT_EQ(g.expert_first[e + 1] - g.expert_first[e], cnt[e]) << "expert " << e;
    want_tiles += (cnt[e] + g.tile_n - 1) / g.tile_n;
    active += cnt[e] > 0;
  }
  ASSERT_EQ(g.tiles, want_tiles);
  std::vector<int> covered(pairs, 0);
  for (int t = 0; t < g.tiles; ++t) {
    const int e = g.tiles4[4 * t], f = g.tiles4[4 * t + 1], n = g.tiles4[4 * t + 2];
    ASSERT_TRUE(e >= 0 && e < E && n >= 1 && n <= g.tile_n && f >= g.expert_first[e] &&
                f + n <= g.expert_first[e + 1])
        << "tile " << t << " (" << e << ", " << f << ", " << n << ")";
    for (int i = f; i < f + n; ++i) ++covered[i];
  }
  for (int i = 0; i < pairs; ++i) ASSERT_EQ(covered[i], 1) << "position " << i;
  std::printf("  %d of %d experts active\n", active, E);

  // The CPU rows of each expert (its own routing), as cpu::moe_forward groups them.
  std::vector<std::vector<int>> rows_of(E), slot_of(E);
  for (int r = 0; r < m; ++r)
    for (int i = 0; i < K; ++i) {
      const int e = csel[size_t(r) * K + i];
      if (!rows_of[e].empty() && rows_of[e].back() == r) continue;
      rows_of[e].push_back(r);
      slot_of[e].push_back(i);
    }
  // Expert by expert on all cores: gate/up + SwiGLU of the GPU's pairs (the GPU's grouping and
  // weights), the down GEMM and its bound from the GPU's own quantised activations, and the
  // layer's expert outputs (the CPU's grouping and weights, cpu::expert_forward).
  std::vector<float> act_ref(size_t(pairs) * inter), actq_ref(size_t(pairs) * inter);
  std::vector<float> ye_ref(size_t(pairs) * dim), ye_bound(size_t(pairs) * dim);
  std::vector<float> out(size_t(m) * K * dim, 0.0f);
  std::vector<char> used(size_t(m) * K, 0), bounded(size_t(pairs), 0);
  parallel_for(E, [&](int e) {
    const int f = g.expert_first[e], n = cnt[e], mc = int(rows_of[e].size());
    if (!n && !mc) return;
    const cpu::ExpertWeights ew = expert_weights(L->ref.experts[e]);
    if (n) {
      std::vector<float> xe(size_t(n) * dim), ge(size_t(n) * inter), ue(size_t(n) * inter);
      for (int j = 0; j < n; ++j)
        std::copy_n(x.data() + size_t(g.sorted_row[f + j]) * dim, dim, xe.data() + size_t(j) * dim);
      cpu::linear(ew.w1, xe.data(), n, ge.data());
      cpu::linear(ew.w3, xe.data(), n, ue.data());
      for (int j = 0; j < n; ++j)
        for (int i = 0; i < inter; ++i) {
          // cpu::expert_forward's SwiGLU, clamp and routing weight, in its order.
          float gi = ge[size_t(j) * inter + i], ui = ue[size_t(j) * inter + i];
          ui = std::clamp(ui, -kLimit, kLimit);
          gi = std::min(gi, kLimit);
          float v = gi / (1.0f + std::exp(-gi)) * ui;
          v = g.sorted_wt[f + j] * v;
          act_ref[size_t(f + j) * inter + i] = round_bf16(v);
        }
      for (int j = 0; j < n; ++j)
        cpu::fake_quant_fp8(g.act.data() + size_t(f + j) * inter, inter, 128,
                            actq_ref.data() + size_t(f + j) * inter);
      cpu::linear(ew.w2, g.actq.data() + size_t(f) * inter, n, ye_ref.data() + size_t(f) * dim);
      if (e % s.bound_every == 0) {
        cpu::linear_error_bound(ew.w2, g.actq.data() + size_t(f) * inter, n, cpu::kBf16Mma,
                                ye_bound.data() + size_t(f) * dim);
        for (int j = 0; j < n; ++j) bounded[size_t(f + j)] = 1;
      }
    }
    if (mc) {
      std::vector<float> xe(size_t(mc) * dim), we(mc), ye(size_t(mc) * dim);
      for (int j = 0; j < mc; ++j) {
        const int r = rows_of[e][j];
        std::copy_n(x.data() + size_t(r) * dim, dim, xe.data() + size_t(j) * dim);
        we[j] = cwt[size_t(r) * K + slot_of[e][j]];
      }
      cpu::expert_forward(ew, kLimit, xe.data(), mc, we.data(), ye.data());
      for (int j = 0; j < mc; ++j) {
        const size_t o = size_t(rows_of[e][j]) * K + slot_of[e][j];
        std::copy_n(ye.data() + size_t(j) * dim, dim, out.data() + o * dim);
        used[o] = 1;
      }
    }
  });
  expect_close(g.act, act_ref, "gate/up GEMM + SwiGLU", nullptr, 1, 4);
  expect_bits_equal(g.actq, actq_ref, "act quantisation");
  {
    std::vector<float> bg, bw, bb;
    for (int i = 0; i < pairs; ++i)
      if (bounded[size_t(i)])
        for (int d = 0; d < dim; ++d) {
          bg.push_back(g.ye[size_t(i) * dim + d]);
          bw.push_back(ye_ref[size_t(i) * dim + d]);
          bb.push_back(ye_bound[size_t(i) * dim + d]);
        }
    ASSERT_FALSE(bb.empty());
    expect_within_bounds(bg, bw, bb, "down GEMM (derived bound, BF16 MMA)");
  }
  expect_close(g.ye, ye_ref, "down GEMM");

  // Combine: exact from the GPU's expert outputs (fp32 sum in ascending expert index).
  std::vector<float> gout(size_t(m) * K * dim, 0.0f);
  std::vector<char> gused(size_t(m) * K, 0);
  for (int r = 0; r < m; ++r)
    for (int i = 0; i < K; ++i) {
      const int pos = g.pair_pos[size_t(r) * K + i];
      if (pos < 0) continue;
      std::copy_n(g.ye.data() + size_t(pos) * dim, dim, gout.data() + (size_t(r) * K + i) * dim);
      gused[size_t(r) * K + i] = 1;
    }
  std::vector<float> y_comb(size_t(m) * dim);
  cpu::moe_combine(g.sel.data(), K, gout.data(), gused.data(), shared.data(), m, dim,
                   y_comb.data());
  expect_bits_equal(g.y, y_comb, "combine");

  // The layer against cpu::moe_forward's computation (the routing is identical).
  std::vector<float> y_ref(size_t(m) * dim);
  cpu::moe_combine(csel.data(), K, out.data(), used.data(), shared.data(), m, dim, y_ref.data());
  expect_close(g.y, y_ref, "MoE layer vs the CPU reference");
}

const ExpertFormat MX = ExpertFormat::kMxfp4, NV = ExpertFormat::kNvfp4;

std::vector<MoeSpec> moe_specs() {
  return {
      // V4-Flash: 256 experts, dim 4096, inter 2048, top-6.
      {"flash_nv_score_m128", 4096, 2048, 256, 6, NV, false, 128},
      {"flash_mx_hash_m128", 4096, 2048, 256, 6, MX, true, 128},
      {"flash_mx_score_m512", 4096, 2048, 256, 6, MX, false, 512, 2},
      // V4-Pro: 384 experts, dim 7168, inter 3072, top-6.
      {"pro_nv_score_m128", 7168, 3072, 384, 6, NV, false, 128, 4},
      // Decode M and M 128 on the stream GEMM, forced (the heuristic picks the tiled one).
      {"flash_nv_score_m1_stream", 4096, 2048, 256, 6, NV, false, 1, 1, cm::MoeGemmPath::kStream},
      {"flash_mx_score_m16_stream", 4096, 2048, 256, 6, MX, false, 16, 1, cm::MoeGemmPath::kStream},
      {"flash_nv_score_m128_stream", 4096, 2048, 256, 6, NV, false, 128, 2,
       cm::MoeGemmPath::kStream},
      // The warp-specialised tiled GEMM (its default 256 tile, forced) with all 256 experts.
      {"flash_mx_score_m512_tiled_ws", 4096, 2048, 256, 6, MX, false, 512, 2,
       cm::MoeGemmPath::kTiledWs},
  };
}

INSTANTIATE_TEST_SUITE_P(Layers, RealShapeMoe, ::testing::ValuesIn(moe_specs()),
                         [](const ::testing::TestParamInfo<MoeSpec>& i) { return i.param.name; });

// ---- RealShapeFp8Gemm -----------------------------------------------------------------------

struct GemmSpec {
  std::string name;
  int m, n, k;
};
std::ostream& operator<<(std::ostream& os, const GemmSpec& s) {
  return os << s.name;
}

class RealShapeFp8Gemm : public ::testing::TestWithParam<GemmSpec> {
 protected:
  void SetUp() override {
    DSV4_SKIP_WITHOUT_GPU();
#if !defined(DSV4_HAVE_CUTLASS)
    GTEST_SKIP() << "built without CUTLASS: no tensor-core path";
#endif
  }
};

TEST_P(RealShapeFp8Gemm, SampledRowsWithinDerivedBound) {
  const GemmSpec& s = GetParam();
  const int m = s.m, n = s.n, k = s.k;
  Rng rng(9000 + uint64_t(n) * 7 + uint64_t(k) + uint64_t(m));
  // Weights with a different magnitude per 128 x 128 block (the scales vary), activations with
  // varying magnitudes per (row, 128) block and ties (gemm_test's generators).
  std::vector<float> w(size_t(n) * k);
  {
    const int nb = (n + 127) / 128, kb = k / 128;
    std::vector<float> mag(size_t(nb) * kb);
    for (auto& v : mag) v = std::ldexp(1.0f, int(rng.below(10)) - 9);
    for (int o = 0; o < n; ++o)
      for (int i = 0; i < k; ++i)
        w[size_t(o) * k + i] = float(rng.normal()) * mag[size_t(o / 128) * kb + i / 128];
  }
  const Fp8Weight q = quantize_fp8_weight(w, n, k);
  w = test::dequantize_fp8(q, n, k);
  const std::vector<float> x = test::random_block_acts(rng, m, k, true);

  cuda::DeviceBuffer<uint8_t> codes(q.codes), e8m0(q.scales);
  cuda::DeviceBuffer<float> scales_t(size_t(k / 128) * ((n + 127) / 128));
  cuda::fp8_weight_scales_to_f32(e8m0.data(), n, k, scales_t.data(), nullptr);
  cuda::DeviceBuffer<uint16_t> dx(to_bf16_bits(x)), dy(size_t(m) * n);
  dy.fill_bytes(0xff);  // NaN everywhere
  const cuda::Fp8GemmPath path = cuda::Fp8GemmPath::kTensorCore;
  const size_t wsb = cuda::fp8_linear_workspace_bytes(m, n, k, path);
  cuda::DeviceBuffer<uint8_t> ws(std::max<size_t>(wsb, 16));
  ws.fill_bytes(0x5a);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  cuda::Fp8LinearParams p;
  p.x = reinterpret_cast<const __nv_bfloat16*>(dx.data());
  p.m = m;
  p.w = {codes.data(), scales_t.data(), n, k};
  p.y = reinterpret_cast<__nv_bfloat16*>(dy.data());
  p.workspace = ws.data();
  p.workspace_bytes = ws.size();
  p.path = path;
  cuda::fp8_linear(p, nullptr);
  DSV4_CUDA_CHECK(cudaGetLastError());
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> all = from_bf16_bits(dy.download());

  // Every row written (no NaN left from the poison), then the sampled rows against the CPU.
  size_t nan = 0;
  for (float v : all) nan += std::isnan(v);
  EXPECT_EQ(nan, 0u) << "outputs left unwritten (or NaN)";
  std::set<int> rows;
  for (int r = 0; r < std::min(m, 8); ++r) rows.insert(r);
  for (int r = std::max(0, m - 8); r < m; ++r) rows.insert(r);
  for (int r = std::min(m, 128) - 4; r < std::min(m, 132); ++r) rows.insert(std::max(r, 0));
  while (int(rows.size()) < std::min(m, 32)) rows.insert(int(rng.below(uint64_t(m))));
  const std::vector<int> sample(rows.begin(), rows.end());
  const int R = int(sample.size());
  const cpu::Linear lin = cpu::Linear::from_rows(cpu::LinearKind::kFp8, n, k, w);
  std::vector<float> xs(size_t(R) * k), got(size_t(R) * n), want(size_t(R) * n),
      bound(size_t(R) * n);
  for (int i = 0; i < R; ++i) {
    std::copy_n(x.data() + size_t(sample[i]) * k, k, xs.data() + size_t(i) * k);
    std::copy_n(all.data() + size_t(sample[i]) * n, n, got.data() + size_t(i) * n);
  }
  parallel_for(R, [&](int i) {
    cpu::linear(lin, xs.data() + size_t(i) * k, 1, want.data() + size_t(i) * n);
    cpu::linear_error_bound(lin, xs.data() + size_t(i) * k, 1, cpu::kFp8WgmmaBlock,
                            bound.data() + size_t(i) * n);
  });
  std::printf("[%s] m %d n %d k %d: %d rows checked\n", s.name.c_str(), m, n, k, R);
  expect_within_bounds(got, want, bound, "FP8 GEMM (derived bound, blockwise FP8 wgmma)");
  test::expect_bf16_close(got, want, n, cat("fp8 gemm tensorcore ", s.name));
}

std::vector<GemmSpec> gemm_specs() {
  std::vector<GemmSpec> v;
  // Every dense FP8 linear of a layer at a prefill chunk of 8192 rows: [n, k].
  const std::vector<std::pair<std::string, std::pair<int, int>>> flash = {
      {"wq_a", {1024, 4096}},      {"wq_b", {32768, 1024}},      {"wkv", {512, 4096}},
      {"wo_b", {4096, 8192}},      {"shared_w13", {4096, 4096}}, {"shared_w2", {4096, 2048}},
      {"index_wq_b", {8192, 1024}}};
  const std::vector<std::pair<std::string, std::pair<int, int>>> pro = {
      {"wq_a", {1536, 7168}},      {"wq_b", {65536, 1536}},      {"wkv", {512, 7168}},
      {"wo_b", {7168, 16384}},     {"shared_w13", {6144, 7168}}, {"shared_w2", {7168, 3072}},
      {"index_wq_b", {8192, 1536}}};
  for (const auto& [name, nk] : flash)
    v.push_back({"flash_" + name + "_m8192", 8192, nk.first, nk.second});
  for (const auto& [name, nk] : pro)
    v.push_back({"pro_" + name + "_m8192", 8192, nk.first, nk.second});
  // The 65-256 row range (batch-128 decode of the dense linears, MTP verify steps).
  v.push_back({"flash_wq_b_m128", 128, 32768, 1024});
  v.push_back({"flash_wo_b_m200", 200, 4096, 8192});
  v.push_back({"pro_shared_w13_m256", 256, 6144, 7168});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Prefill, RealShapeFp8Gemm, ::testing::ValuesIn(gemm_specs()),
                         [](const ::testing::TestParamInfo<GemmSpec>& i) { return i.param.name; });

}  // namespace
}  // namespace dsv4
