// CUDA MoE (src/ops/cuda/moe) against the CPU reference (ops/cpu/moe.h, linear.h, quant.h).
//
// MoePack.*  (host only, runs everywhere): the FP4 repack, read back through the kernels' own
//            bit-level dequantisation helpers, gives exactly e2m1 x scale of the checkpoint.
// MoeGemmEmu.* (host only): the grouped GEMM kernel's loads, in-place act quantisation,
//            fragment/scale indexing, swizzled B reads and epilogue indices replayed on the
//            host for every token tile, gate/up and down, give the exact products.
// MoeCuda.*  (GPU): every stage of moe_forward vs its CPU op on fresh random inputs, with
//            poisoned outputs and workspace: router selections and weights (cpu::moe_route;
//            only near-ties may differ), x quantisation (bytes identical), grouping, gate/up
//            GEMM + SwiGLU, act quantisation (bytes identical), down GEMM, combine (bit-exact
//            from the GPU's own expert outputs) and the layer output (cpu::moe_forward).
// GEMM/layer outputs: relative L2 <= 4e-3 and >= 99 % of elements within 1 BF16 ulp; GEMM
// stages also: no element off by more than 4 BF16 ulps of the largest reference value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/formats.h"
#include "cuda/cuda_support.h"
#include "cuda/gpu_test.h"
#include "model/weight_quant.h"
#include "ops/cpu/dequant.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/quant.h"
#include "ops/cuda/common/device.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/moe/fp4_pack.h"
#include "ops/cuda/moe/moe.h"
#include "ops/cuda/moe/moe_gemm.cuh"
#include "ops/cuda/moe/moe_gemm_stream.cuh"
#include "ops/cuda/moe/moe_kernels.h"
#include "support/bf16_vectors.h"
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

// ---- host checkpoint tensors ---------------------------------------------------------------

// One FP4 projection [out, in] in a checkpoint format. Small shapes quantise Gaussian
// weights with the checkpoint quantisers (NVFP4 with the given non-power-of-two global
// scale), then plant the scale edge cases the repack must fold exactly: zero, negative and
// subnormal E4M3 block scales. Large shapes draw codes and scales directly (fast).
Fp4Ref make_fp4(HostTensors& h, const std::string& name, ExpertFormat f, int out, int in,
                float w_std, float scale_2, bool direct, int mx_exp_shift, std::mt19937& rng) {
  Fp4Ref r;
  r.format = f;
  std::vector<uint8_t> packed, scales;
  float g = scale_2;
  if (!direct) {
    std::vector<float> w = gaussian(size_t(out) * in, w_std, rng, false);
    if (mx_exp_shift)
      for (float& x : w) x = std::ldexp(x, mx_exp_shift);
    if (f == ExpertFormat::kMxfp4) {
      Mxfp4Weight q = quantize_mxfp4_weight(w, out, in);
      packed = std::move(q.packed);
      scales = std::move(q.scales);
    } else {
      Nvfp4Weight q = quantize_nvfp4_weight(w, out, in, scale_2);
      packed = std::move(q.packed);
      scales = std::move(q.scales);
      std::uniform_int_distribution<size_t> pick(0, scales.size() - 1);
      for (size_t i = 0; i < scales.size() / 64 + 1; ++i) {
        scales[pick(rng)] = 0x00;                                 // zero block scale
        scales[pick(rng)] |= 0x80;                                // negative block scale
        scales[pick(rng)] = static_cast<uint8_t>(1 + rng() % 7);  // subnormal E4M3
      }
    }
  } else {
    packed.resize(size_t(out) * in / 2);
    for (uint8_t& b : packed) b = static_cast<uint8_t>(rng());
    const float s = w_std / 2.93f;  // uniform e2m1 codes have std ~2.93
    if (f == ExpertFormat::kMxfp4) {
      const int center = 127 + int(std::lround(std::log2(s))) + mx_exp_shift;
      scales.resize(size_t(out) * in / 32);
      for (uint8_t& b : scales) b = static_cast<uint8_t>(center - 1 + int(rng() % 3));
    } else {
      scales.resize(size_t(out) * in / 16);
      for (uint8_t& b : scales) b = static_cast<uint8_t>(0x38 + rng() % 13);  // 1.0 .. 2.5
      g = s / 1.7f * 1.1371f;
    }
  }
  r.weight = h.add(name + ".weight", DType::kU8, {out, in / 2}, std::move(packed));
  if (f == ExpertFormat::kMxfp4) {
    r.scale = h.add(name + ".scale", DType::kF8E8M0, {out, in / 32}, std::move(scales));
  } else {
    r.scale = h.add(name + ".weight_scale", DType::kF8E4M3, {out, in / 16}, std::move(scales));
    r.scale_2 = h.add(name + ".weight_scale_2", DType::kF32, {}, as_bytes(std::vector<float>{g}));
  }
  return r;
}

// ---- MoePack: host emulation of the kernel's dequantisation ---------------------------------

// Value the kernel feeds the MMA for packed element (row, col), times the power of two it
// multiplies back in the epilogue: must equal e2m1 * scale of the checkpoint exactly.
float emulate_packed(const cm::PackedFp4& p, int row, int col, bool* bf16_exact) {
  const int kb_count = p.cols / cm::kPackK, tile = cm::pack_tile_bytes(p.format);
  const uint8_t* t = p.bytes.data() + (size_t(row / 64) * kb_count + col / 64) * tile;
  const cm::TileSlot s = cm::tile_slot(p.format, row % 64, col % 64);
  uint32_t word;
  std::memcpy(&word, t + 16 * s.thread + 4 * s.kk, 4);
  uint32_t v[4];
  cm::fp4_word_to_bf16x2(word, v);
  const uint32_t vb = s.half ? v[s.reg] >> 16 : v[s.reg] & 0xffff;
  const bool rhi = (row % 16) >= 8;
  const cm::Fp4Scale& ep = rhi ? p.epi.b : p.epi.a;
  const uint32_t sb = p.format == ExpertFormat::kMxfp4
                          ? cm::fp4_scale_bf16x2<ExpertFormat::kMxfp4>(
                                t[cm::kPackCodeBytes + s.scale_byte], ep.bias)
                          : cm::fp4_scale_bf16x2<ExpertFormat::kNvfp4>(
                                t[cm::kPackCodeBytes + s.scale_byte], ep.bias);
  // Both halves of the scale must agree; the product of two BF16 values is exact in fp32.
  EXPECT_EQ(sb >> 16, sb & 0xffff);
  const float prod = bf16_to_float(uint16_t(vb)) * bf16_to_float(uint16_t(sb & 0xffff));
  *bf16_exact = round_bf16(prod) == prod;
  return prod;
}

// The power of two the epilogue multiplies back (mult without NVFP4's scale_2).
float pow2_part(const cm::Fp4Scale& e, const Fp4Ref& r) {
  if (r.format == ExpertFormat::kMxfp4) return e.mult;
  float g;
  std::memcpy(&g, r.scale_2->data, 4);
  return e.mult / g;
}

// e2m1 x scale of the checkpoint (without NVFP4's scale_2), exact in float.
float checkpoint_value(const Fp4Ref& r, int o, int i) {
  const int in = static_cast<int>(r.weight->shape[1] * 2);
  const uint8_t byte = r.weight->data[size_t(o) * (in / 2) + i / 2];
  const float c = e2m1_to_float((i % 2) ? e2m1_high(byte) : e2m1_low(byte));
  if (r.format == ExpertFormat::kMxfp4)
    return c * e8m0_to_float(r.scale->data[size_t(o) * (in / 32) + i / 32]);
  return c * e4m3_to_float(r.scale->data[size_t(o) * (in / 16) + i / 16]);
}

void check_pack(const Fp4Ref& r, const cm::PackedFp4& p, const Fp4Ref* r3) {
  int bad = 0;
  for (int row = 0; row < p.rows; ++row)
    for (int col = 0; col < p.cols; ++col) {
      const Fp4Ref* src = &r;
      int srow = row;
      const cm::Fp4Scale* ep = &p.epi.a;
      if (r3) {
        int proj;
        cm::gate_up_source(row, proj, srow);
        if (proj) src = r3, ep = &p.epi.b;
      }
      bool exact = false;
      const float got = emulate_packed(p, row, col, &exact) * pow2_part(*ep, *src);
      const float want = checkpoint_value(*src, srow, col);
      if ((got != want || !exact) && bad++ < 5)
        ADD_FAILURE() << "packed (" << row << ", " << col << ") from row " << srow << ": kernel "
                      << got << " (BF16 exact " << exact << "), checkpoint " << want;
    }
  EXPECT_EQ(bad, 0);
}

TEST(MoePack, EmulatedDequantIsExactMxfp4) {
  std::mt19937 rng(11);
  HostTensors h;
  for (int shift : {0, 12, -120}) {  // 12, -120: scale bytes beyond 128 / below 2 move the bias
    const Fp4Ref w = make_fp4(h, "w", ExpertFormat::kMxfp4, 128, 192, 0.05f, 0, false, shift, rng);
    const cm::PackedFp4 p = cm::pack_fp4(w);
    SCOPED_TRACE(shift);
    EXPECT_EQ(p.bytes.size(), size_t(2) * 3 * cm::pack_tile_bytes(ExpertFormat::kMxfp4));
    check_pack(w, p, nullptr);
  }
}

// The stream GEMM's two-scale expansion (fp4_scale_row_pair, one half picked per multiply)
// gives, in each half, fp4_scale_bf16x2's value of that half's record byte -- for the biases the
// packer produces (MXFP4 with shifted exponents included) and every byte whose scale fits a
// BF16 half (b * mul + bias < 2^16, as fp4_scale_bf16x2 itself assumes).
TEST(MoePack, ScaleRowPairHalvesAreTheBroadcastScales) {
  std::mt19937 rng(13);
  HostTensors h;
  std::vector<std::pair<ExpertFormat, uint32_t>> biases;
  for (int shift : {0, 12, -120}) {
    const Fp4Ref w = make_fp4(h, "w", ExpertFormat::kMxfp4, 64, 64, 0.05f, 0, false, shift, rng);
    biases.push_back({ExpertFormat::kMxfp4, cm::pack_fp4(w).epi.a.bias});
  }
  biases.push_back({ExpertFormat::kNvfp4, cm::kNvScaleBias * 0x10001u});
  int checked = 0;
  for (const auto& [f, bias] : biases) {
    const bool mx = f == ExpertFormat::kMxfp4;
    const uint32_t mul = mx ? 128u : 16u;
    auto fits = [&](uint32_t b) { return b * mul + (bias & 0xffffu) < 0x10000u; };
    auto broadcast = [&](uint32_t b) {
      return mx ? cm::fp4_scale_bf16x2<ExpertFormat::kMxfp4>(b, bias)
                : cm::fp4_scale_bf16x2<ExpertFormat::kNvfp4>(b, bias);
    };
    for (int i = 0; i < 20000; ++i) {
      const uint32_t word = i < 256 ? uint32_t(i) * 0x01010101u : uint32_t(rng());
      for (bool odd : {false, true}) {
        const uint32_t pair = mx ? cm::fp4_scale_row_pair<ExpertFormat::kMxfp4>(word, odd, bias)
                                 : cm::fp4_scale_row_pair<ExpertFormat::kNvfp4>(word, odd, bias);
        const uint32_t b_lo = (word >> (odd ? 8 : 0)) & 0xffu,
                       b_hi = (word >> (odd ? 24 : 16)) & 0xffu;
        if (!fits(b_lo) || !fits(b_hi)) continue;
        ASSERT_EQ(pair & 0xffffu, broadcast(b_lo) & 0xffffu) << std::hex << word << " " << odd;
        ASSERT_EQ(pair >> 16, broadcast(b_hi) >> 16) << std::hex << word << " " << odd;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 50000);
}

TEST(MoePack, EmulatedDequantIsExactNvfp4) {
  std::mt19937 rng(12);
  HostTensors h;
  std::vector<float> probe = gaussian(64 * 128, 0.05f, rng, false);
  const float g = nvfp4_global_scale(probe) * 1.3f;  // a general, non-power-of-two scale_2
  const Fp4Ref w = make_fp4(h, "w", ExpertFormat::kNvfp4, 64, 128, 0.05f, g, false, 0, rng);
  check_pack(w, cm::pack_fp4(w), nullptr);
}

TEST(MoePack, GateUpInterleave) {
  for (ExpertFormat f : {ExpertFormat::kMxfp4, ExpertFormat::kNvfp4}) {
    std::mt19937 rng(13);
    HostTensors h;
    const Fp4Ref w1 = make_fp4(h, "w1", f, 96, 128, 0.05f, 1.7e-5f, false, 0, rng);
    const Fp4Ref w3 = make_fp4(h, "w3", f, 96, 128, 0.02f, 0.9e-5f, false, 0, rng);
    const cm::PackedFp4 p = cm::pack_fp4_gate_up(w1, w3);
    EXPECT_EQ(p.rows, 192);
    check_pack(w1, p, &w3);
  }
}

TEST(MoePack, RejectsWhatItCannotRepresent) {
  std::mt19937 rng(14);
  HostTensors h;
  Fp4Ref w = make_fp4(h, "w", ExpertFormat::kMxfp4, 64, 64, 0.05f, 0, false, 0, rng);
  auto& sc = h.data[h.data.size() - 1];
  sc[0] = 0xff;  // NaN scale
  EXPECT_THROW(cm::pack_fp4(w), Error);
  sc[0] = 1;
  sc[1] = 200;  // exponents spanning 199 binades
  EXPECT_THROW(cm::pack_fp4(w), Error);
  Fp4Ref odd = make_fp4(h, "odd", ExpertFormat::kMxfp4, 32, 64, 0.05f, 0, false, 0, rng);
  EXPECT_THROW(cm::pack_fp4(odd), Error);  // 32 rows: off the 64-row tile grid
}

// ---- MoeGemmEmu: the grouped expert GEMM's index arithmetic, run on the host -----------------
//
// The kernel's work items replayed step by step with its own constants and address formulas:
// load_chunk's gathers into the stage buffer, the in-place FP8 quantisation of decode down
// GEMMs (lane -> element map), each thread's 16-byte word and scale record per k-block, the
// scale byte selection and BF16 dequantisation per k16 step; then the MMA as the hardware
// defines it (A fragment rows/columns, B read through the 128-byte-swizzle descriptor at
// +32 bytes per k16 step), the accumulator -> (row, column) map and the epilogue's output
// indices. Sums are exact (double) and compared with the checkpoint's e2m1 x scale x
// activation products, so any misplaced row, K block, scale or token shows, independent of
// rounding. (It cannot see ordering hazards: those are checked on the GPU.)

namespace emu {

uint32_t bf16x2_mul(uint32_t a, uint32_t b) {  // fma.rn.bf16x2 a, b, -0
  uint32_t r = 0;
  for (int h = 0; h < 2; ++h) {
    const float p = bf16_to_float(uint16_t(a >> (16 * h))) * bf16_to_float(uint16_t(b >> (16 * h)));
    r |= uint32_t(float_to_bf16(p)) << (16 * h);
  }
  return r;
}
// The 128-byte swizzle of the wgmma descriptor: address bits [4, 7) ^= bits [7, 10).
uint32_t sw128(uint32_t a) {
  return a ^ (((a >> 7) & 7u) << 4);
}
float bf(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return bf16_to_float(b);
}

struct Result {
  std::vector<double> d0, d1;         // down: d0 = output [pos, ldo]; gate/up: g and u
  std::vector<int> writes0, writes1;  // how often each output element was stored
  std::vector<uint16_t> act_q;        // decode down GEMM: the quantised rows it stores
  std::vector<int> act_q_writes;
};

// pw: the packed projection; act: BF16 bits [rows, k]; act_row: position -> act row (empty:
// identity); tiles: (first position, rows) of one expert; positions: total positions.
template <ExpertFormat F, class T, bool GATE_UP>
Result run(const cm::PackedFp4& pw, int k, const std::vector<uint16_t>& act,
           const std::vector<int32_t>& act_row, const std::vector<std::pair<int, int>>& tiles,
           int positions, int ldo) {
  constexpr int TILE = cm::pack_tile_bytes(F);
  constexpr int B_KB = T::BN * 128;
  constexpr int B_BYTES = T::KC * B_KB;
  constexpr int STAGE = cm::gemm_stage_bytes<F, T>();
  constexpr int NACC = T::BN / 2;
  constexpr bool QUANT_B = !GATE_UP && cm::gemm_quantises_b<T>();
  static_assert(STAGE % 1024 == 0 && B_KB % 1024 == 0, "swizzle atoms stay 1024-byte aligned");
  Result res;
  res.d0.assign(size_t(positions) * ldo, 0.0);
  res.d1.assign(size_t(positions) * ldo, 0.0);
  res.writes0.assign(size_t(positions) * ldo, 0);
  res.writes1.assign(size_t(positions) * ldo, 0);
  if (QUANT_B) {
    res.act_q.assign(size_t(positions) * k, 0xffff);
    res.act_q_writes.assign(size_t(positions) * k, 0);
  }
  std::vector<uint8_t> smem(size_t(T::STAGES) * STAGE);
  const int KB = k / 64, nch = (KB + T::KC - 1) / T::KC, row_blocks = pw.rows / T::BM;
  EXPECT_EQ(pw.rows % T::BM, 0);
  const int total = int(tiles.size()) * row_blocks;
  const auto ep = pw.epi;
  for (int item = 0; item < total; ++item) {
    const int first = tiles[item / row_blocks].first, rows = tiles[item / row_blocks].second;
    const int rbc = item % row_blocks;
    const uint8_t* wbase = pw.bytes.data() + size_t(rbc) * (T::WGS * T::MT) * KB * TILE;
    std::fill(smem.begin(), smem.end(), uint8_t(0xff));  // stale data: NaN BF16
    int s_row[T::BN];
    for (int tid = 0; tid < T::BN; ++tid)
      s_row[tid] = tid < rows ? (act_row.empty() ? first + tid : act_row[first + tid]) : -1;
    const int quarters = T::BN >= 64 ? std::min(4, (4 * rows + T::BN - 1) / T::BN) : 4;
    const int ncols = quarters * T::BN / 4;  // MMA width
    // D[wg][mt][64 rows][BN columns], exact.
    std::vector<double> D(size_t(T::WGS) * T::MT * 64 * T::BN, 0.0);
    for (int ch = 0; ch < nch; ++ch) {
      const uint32_t st_off = uint32_t((ch % T::STAGES) * STAGE);
      uint8_t* st = smem.data() + st_off;
      const int kb0 = ch * T::KC, nk = std::min(T::KC, KB - kb0);
      // load_chunk(ch), every thread's iterations.
      for (int i = 0; i < T::KC * T::BN * 8; ++i) {
        const int kbl = i / (T::BN * 8), r = (i / 8) % T::BN, c = i % 8;
        if (kbl < nk && r < rows)
          std::memcpy(st + kbl * B_KB + r * 128 + ((c ^ (r & 7)) << 4),
                      act.data() + size_t(s_row[r]) * k + (kb0 + kbl) * 64 + c * 8, 16);
      }
      constexpr int CH_PER_SET = T::KC * TILE / 16;
      for (int i = 0; i < T::WGS * T::MT * CH_PER_SET; ++i) {
        const int gm = i / CH_PER_SET, j = i % CH_PER_SET;
        if (j * 16 < nk * TILE)
          std::memcpy(st + B_BYTES + gm * (T::KC * TILE) + j * 16,
                      wbase + size_t(gm) * KB * TILE + size_t(kb0) * TILE + j * 16, 16);
      }
      if constexpr (QUANT_B) {  // quant_b_block, one warp per (row, 128-block)
        const int blocks = nk / 2;
        for (int task = 0; task < rows * blocks; ++task) {
          const int r = task / blocks, j = task % blocks;
          uint8_t* p[32];
          float v[32][4], amax = 0;
          for (int lane = 0; lane < 32; ++lane) {
            const int kb = 2 * j + lane / 16, c = (lane % 16) / 2;
            p[lane] = st + kb * B_KB + r * 128 + ((c ^ (r & 7)) << 4) + (lane % 2) * 8;
            for (int e = 0; e < 4; ++e) {
              v[lane][e] = bf(p[lane] + 2 * e);
              amax = std::max(amax, std::fabs(v[lane][e]));
            }
          }
          const float s = pow2_ceil(std::max(amax, 1e-4f) * (1.0f / 448.0f));
          for (int lane = 0; lane < 32; ++lane)
            for (int e = 0; e < 4; ++e) {
              const float q = std::clamp(v[lane][e] / s, -448.0f, 448.0f);
              const uint16_t b = float_to_bf16(e4m3_to_float(float_to_e4m3(q)) * s);
              std::memcpy(p[lane] + 2 * e, &b, 2);
              if (rbc == 0) {
                const size_t o = size_t(first + r) * k + (ch * T::KC + 2 * j) * 64 + 4 * lane + e;
                res.act_q[o] = b;
                ++res.act_q_writes[o];
              }
            }
        }
      }
      for (int kbl = 0; kbl < nk; ++kbl)
        for (int wg = 0; wg < T::WGS; ++wg)
          for (int mt = 0; mt < T::MT; ++mt) {
            const uint8_t* tl = st + B_BYTES + ((wg * T::MT + mt) * T::KC + kbl) * TILE;
            const uint32_t b_base = st_off + uint32_t(kbl * B_KB);  // descriptor start
            for (int kk = 0; kk < 4; ++kk) {
              // A[64][16] from the 128 threads' fragments.
              float A[64][16];
              for (int t = 0; t < 128; ++t) {
                const int warp = t / 32, lane = t % 32, rp = 8 * warp + lane / 4;
                uint32_t words[4], sc_lo, sc_hi = 0;
                std::memcpy(words, tl + 16 * t, 16);
                if (F == ExpertFormat::kMxfp4) {
                  std::memcpy(&sc_lo, tl + cm::kPackCodeBytes + 4 * rp, 4);
                } else {
                  std::memcpy(&sc_lo, tl + cm::kPackCodeBytes + 8 * rp, 4);
                  std::memcpy(&sc_hi, tl + cm::kPackCodeBytes + 8 * rp + 4, 4);
                }
                // Two scale groups a word, one per half (fp4_scale_row_pair); the k16 step's
                // half broadcast to both (dequant_k16_half).
                const bool mx = F == ExpertFormat::kMxfp4;
                const uint32_t src = mx || kk < 2 ? sc_lo : sc_hi;
                const bool hi = mx ? kk >= 2 : kk % 2 == 1;
                const uint32_t p0 = cm::fp4_scale_row_pair<F>(src, false, ep.a.bias);
                const uint32_t p1 = cm::fp4_scale_row_pair<F>(src, true, ep.b.bias);
                const uint32_t s0 = hi ? (p0 >> 16) * 0x10001u : (p0 & 0xffffu) * 0x10001u;
                const uint32_t s1 = hi ? (p1 >> 16) * 0x10001u : (p1 & 0xffffu) * 0x10001u;
                uint32_t v[4], a[4];
                cm::fp4_word_to_bf16x2(words[kk], v);
                a[0] = bf16x2_mul(v[0], s0);
                a[1] = bf16x2_mul(v[1], s1);
                a[2] = bf16x2_mul(v[2], s0);
                a[3] = bf16x2_mul(v[3], s1);
                // wgmma A fragment: a0 (r, c..c+1), a1 (r+8, c..), a2 (r, c+8..), a3 (r+8, c+8..)
                const int r0 = 16 * warp + lane / 4, c0 = 2 * (lane % 4);
                for (int reg = 0; reg < 4; ++reg)
                  for (int h = 0; h < 2; ++h)
                    A[r0 + 8 * (reg % 2)][c0 + 8 * (reg / 2) + h] =
                        bf16_to_float(uint16_t(a[reg] >> (16 * h)));
              }
              // B[16][ncols] through the descriptor: K-major rows of 128 bytes, 8-row groups
              // 1024 bytes apart, start + 32 bytes per k16 step, swizzled by address.
              double* d = D.data() + (size_t(wg) * T::MT + mt) * 64 * T::BN;
              for (int n = 0; n < ncols; ++n) {
                float B[16];
                for (int kin = 0; kin < 16; ++kin)
                  B[kin] = bf(smem.data() +
                              sw128(b_base + 32 * kk + (n / 8) * 1024 + (n % 8) * 128 + 2 * kin));
                for (int row = 0; row < 64; ++row) {
                  double sum = 0;
                  for (int kin = 0; kin < 16; ++kin) sum += double(A[row][kin]) * B[kin];
                  d[row * T::BN + n] += sum;
                }
              }
            }
          }
    }
    // Epilogue, with the wgmma accumulator map: accumulator i of a thread holds row
    // 16 warp + lane/4 + 8 ((i % 4) / 2), column 8 (i / 4) + 2 (lane % 4) + i % 2.
    for (int wg = 0; wg < T::WGS; ++wg)
      for (int mt = 0; mt < T::MT; ++mt) {
        const double* d = D.data() + (size_t(wg) * T::MT + mt) * 64 * T::BN;
        const int rb64 = rbc * (T::WGS * T::MT) + wg * T::MT + mt;
        for (int t = 0; t < 128; ++t) {
          const int warp = t / 32, lane = t % 32;
          auto acc = [&](int i) {
            EXPECT_LT(i, NACC);
            return d[(16 * warp + lane / 4 + 8 * ((i % 4) / 2)) * T::BN + 8 * (i / 4) +
                     2 * (lane % 4) + i % 2];
          };
          for (int j = 0; j < T::BN / 8; ++j)
            for (int q = 0; q < 2; ++q) {
              const int col = 8 * j + 2 * (lane % 4) + q;
              if (col >= rows) continue;
              const int pos = first + col;
              const double d0 = acc(4 * j + q), d1 = acc(4 * j + 2 + q);
              if (GATE_UP) {
                const int i = rb64 * 32 + 8 * warp + lane / 4;
                res.d0[size_t(pos) * ldo + i] = d0 * ep.a.mult;
                res.d1[size_t(pos) * ldo + i] = d1 * ep.b.mult;
                ++res.writes0[size_t(pos) * ldo + i];
                ++res.writes1[size_t(pos) * ldo + i];
              } else {
                const int n = rb64 * 64 + 16 * warp + lane / 4;
                res.d0[size_t(pos) * ldo + n] = d0 * ep.a.mult;
                res.d0[size_t(pos) * ldo + n + 8] = d1 * ep.b.mult;
                ++res.writes0[size_t(pos) * ldo + n];
                ++res.writes0[size_t(pos) * ldo + n + 8];
              }
            }
        }
      }
  }
  return res;
}

// sum_k W[o, k] * x[k] exactly (W = e2m1 x block scale x NVFP4's scale_2) and sum_k |..|.
std::pair<double, double> exact_dot(const Fp4Ref& w, int o, const float* x, int k) {
  double g = 1;
  if (w.format == ExpertFormat::kNvfp4) {
    float g32;
    std::memcpy(&g32, w.scale_2->data, 4);
    g = g32;
  }
  double s = 0, sa = 0;
  for (int i = 0; i < k; ++i) {
    const double p = double(checkpoint_value(w, o, i)) * g * x[i];
    s += p;
    sa += std::fabs(p);
  }
  return {s, sa};
}

int count_bad(const std::vector<double>& got, const std::vector<int>& writes, int positions, int n,
              const std::function<std::pair<double, double>(int, int)>& want, const char* what) {
  int bad = 0;
  for (int pos = 0; pos < positions; ++pos)
    for (int o = 0; o < n; ++o) {
      const size_t idx = size_t(pos) * n + o;
      const auto [w, wa] = want(pos, o);
      const double g = got[idx];
      const bool ok = writes[idx] == 1 && std::fabs(g - w) <= 1e-12 * wa + 1e-300;
      if (!ok && bad++ < 5)
        ADD_FAILURE() << what << " (position " << pos << ", output " << o << "): stored "
                      << writes[idx] << "x, emulated " << g << ", exact " << w;
    }
  return bad;
}

template <ExpertFormat F, class T>
void check_down(int dim, int inter, int n_tok, uint32_t seed) {
  SCOPED_TRACE(cat("down, BN ", T::BN, ", dim ", dim, ", inter ", inter, ", ", n_tok, " tokens"));
  std::mt19937 rng(seed);
  HostTensors h;
  const float g2 = F == ExpertFormat::kNvfp4 ? 0.2f / std::sqrt(float(inter)) * 4.5f / 2688.0f : 0;
  const Fp4Ref w2 =
      make_fp4(h, "w2", F, dim, inter, 0.2f / std::sqrt(float(inter)), g2, false, 0, rng);
  const cm::PackedFp4 p = cm::pack_fp4(w2);
  // SwiGLU outputs: BF16, rows of different magnitude (per-128 scales differ along K too).
  std::vector<float> act = gaussian(size_t(n_tok) * inter, 1.0f, rng);
  for (int r = 0; r < n_tok; ++r)
    for (int i = 0; i < inter; ++i)
      act[size_t(r) * inter + i] =
          round_bf16(act[size_t(r) * inter + i] * std::ldexp(1.0f, (r % 5) - 2 + (i / 128) % 3));
  std::vector<float> actq(act.size());
  for (int r = 0; r < n_tok; ++r)
    cpu::fake_quant_fp8(act.data() + size_t(r) * inter, inter, 128,
                        actq.data() + size_t(r) * inter);
  constexpr bool quant = cm::gemm_quantises_b<T>();
  // Decode tiles read the SwiGLU output and quantise it; prefill tiles read quant_rows' output.
  const std::vector<uint16_t> in = to_bf16_bits(quant ? act : actq);
  std::vector<std::pair<int, int>> tiles;
  for (int f = 0; f < n_tok; f += T::BN) tiles.push_back({f, std::min(T::BN, n_tok - f)});
  const Result r = run<F, T, false>(p, inter, in, {}, tiles, n_tok, dim);
  const int bad = count_bad(
      r.d0, r.writes0, n_tok, dim,
      [&](int pos, int o) { return exact_dot(w2, o, actq.data() + size_t(pos) * inter, inter); },
      "down GEMM");
  EXPECT_EQ(bad, 0);
  if (quant) {
    int qbad = 0;
    for (size_t i = 0; i < actq.size(); ++i)
      if ((r.act_q_writes[i] != 1 || r.act_q[i] != float_to_bf16(actq[i])) && qbad++ < 5)
        ADD_FAILURE() << "quantised activation [" << i << "]: stored " << r.act_q_writes[i] << "x, "
                      << bf16_to_float(r.act_q[i]) << " vs " << actq[i];
    EXPECT_EQ(qbad, 0);
  }
}

template <ExpertFormat F, class T>
void check_gate_up(int dim, int inter, int n_tok, uint32_t seed) {
  SCOPED_TRACE(
      cat("gate/up, BN ", T::BN, ", dim ", dim, ", inter ", inter, ", ", n_tok, " tokens"));
  std::mt19937 rng(seed);
  HostTensors h;
  const float s13 = 4.0f / std::sqrt(float(dim));
  const float g13 = F == ExpertFormat::kNvfp4 ? s13 * 4.5f / 2688.0f : 0;
  const Fp4Ref w1 = make_fp4(h, "w1", F, inter, dim, s13, g13, false, 0, rng);
  const Fp4Ref w3 = make_fp4(h, "w3", F, inter, dim, s13, g13 * 1.25f, false, 0, rng);
  const cm::PackedFp4 p = cm::pack_fp4_gate_up(w1, w3);
  // x rows (quantised), gathered through a position -> row map with repeats.
  const int x_rows = n_tok / 2 + 1;
  std::vector<float> x = gaussian(size_t(x_rows) * dim, 1.0f, rng), xq(x.size());
  for (int r = 0; r < x_rows; ++r)
    cpu::fake_quant_fp8(x.data() + size_t(r) * dim, dim, 128, xq.data() + size_t(r) * dim);
  std::vector<int32_t> act_row(n_tok);
  for (int i = 0; i < n_tok; ++i) act_row[i] = int32_t(rng() % x_rows);
  std::vector<std::pair<int, int>> tiles;
  for (int f = 0; f < n_tok; f += T::BN) tiles.push_back({f, std::min(T::BN, n_tok - f)});
  const Result r = run<F, T, true>(p, dim, to_bf16_bits(xq), act_row, tiles, n_tok, inter);
  auto want = [&](const Fp4Ref& w) {
    return [&](int pos, int i) {
      return exact_dot(w, i, xq.data() + size_t(act_row[pos]) * dim, dim);
    };
  };
  EXPECT_EQ(count_bad(r.d0, r.writes0, n_tok, inter, want(w1), "gate (w1)"), 0);
  EXPECT_EQ(count_bad(r.d1, r.writes1, n_tok, inter, want(w3), "up (w3)"), 0);
}

template <ExpertFormat F>
void check_all_tiles(uint32_t seed) {
  // inter 128: one partial chunk for the 8 tile (nk 2 < KC 4); 384: 6 k-blocks, a full and a
  // partial chunk (8 tile) or three chunks; 2048 (Flash): 8 to 16 chunks, every stage reused.
  for (int inter : {128, 384, 2048}) {
    check_down<F, cm::TileN8>(256, inter, 13, seed + inter);
    check_down<F, cm::TileN32>(256, inter, 37, seed + inter + 1);
  }
  for (int inter : {128, 384}) {
    check_down<F, cm::TileN64>(256, inter, 70, seed + inter + 2);
    check_down<F, cm::TileN128>(256, inter, 150, seed + inter + 3);  // MMA widths 128 and 32
  }
  // Token tiles with every MMA width of the prefill tiles: 64 + 1 rows (N 64, 16); 128 + 50
  // (N 128, 64), 128 + 72 (N 128, 96); the down GEMM above 64 + 6 and 128 + 22 (N 16, 32).
  // The stream (decode) GEMM's geometry: one 64-row block per item, KC 4, N 8 or 16 (N 16:
  // two 8-row swizzle atoms of activations per k-block); its indexing is this kernel's with
  // WGS = MT = 1 (moe_gemm_stream.cuh: the two consumers' K halves only add).
  using Stream8 = cm::GemmTile<cm::StreamN8::BN, 1, 1, cm::StreamN8::KC, cm::StreamN8::STAGES, 4>;
  using Stream16 =
      cm::GemmTile<cm::StreamN16::BN, 1, 1, cm::StreamN16::KC, cm::StreamN16::STAGES, 4>;
  static_assert(cm::gemm_stage_bytes<F, Stream16>() == cm::stream_stage_bytes<F, cm::StreamN16>());
  static_assert(cm::gemm_stage_bytes<F, Stream8>() == cm::stream_stage_bytes<F, cm::StreamN8>());
  for (int inter : {128, 384}) {
    check_down<F, Stream16>(256, inter, 21, seed + inter + 5);
    check_gate_up<F, Stream16>(256 + inter, 128, 19, seed + inter + 6);
  }
  for (int dim : {256, 384}) {
    check_gate_up<F, cm::TileN8>(dim, 128, 11, seed + dim);
    check_gate_up<F, cm::TileN32>(dim, 128, 33, seed + dim + 1);
    check_gate_up<F, cm::TileN64>(dim, 128, 65, seed + dim + 2);
    check_gate_up<F, cm::TileN128>(dim, 128, dim == 256 ? 178 : 200, seed + dim + 3);
  }
}

}  // namespace emu

TEST(MoeGemmEmu, KernelIndexingIsExactMxfp4) {
  emu::check_all_tiles<ExpertFormat::kMxfp4>(100);
}

TEST(MoeGemmEmu, KernelIndexingIsExactNvfp4) {
  emu::check_all_tiles<ExpertFormat::kNvfp4>(200);
}

// The router kernel choice (host only): kAuto takes the K-parallel kernel up to 2 rows and the
// fp64 MMA beyond; a forced choice is kept, the K-parallel kernel refused beyond 256 rows.
TEST(MoeRouterPath, AutoAndForced) {
  using RP = cm::RouterPath;
  for (int m : {1, 2}) EXPECT_EQ(cm::router_path_choice(m, RP::kAuto), RP::kGemv) << m;
  for (int m : {3, 4, 5, 8, 32, 128, 2048})
    EXPECT_EQ(cm::router_path_choice(m, RP::kAuto), RP::kMma) << m;
  for (int m : {2049, 4096, 8192}) EXPECT_EQ(cm::router_path_choice(m, RP::kAuto), RP::kTiled) << m;
  EXPECT_EQ(cm::router_path_choice(4096, RP::kTiled), RP::kTiled);
  EXPECT_EQ(cm::router_path_choice(1, RP::kMma), RP::kMma);
  EXPECT_EQ(cm::router_path_choice(256, RP::kGemv), RP::kGemv);
  EXPECT_THROW(cm::router_path_choice(257, RP::kGemv), Error);
  EXPECT_EQ(cm::router_kernel_name(1), "router_gemv<1,2>");
  EXPECT_EQ(cm::router_kernel_name(300), "router_mma<16x32>");
  EXPECT_EQ(cm::router_kernel_name(4096), "router_tiled<64,128>");
}

// The expert GEMM heuristic on the real geometries (host only: it reads the shape, not the
// weights).
TEST(MoeGemmChoice, RealShapes) {
  auto shape = [](int E, int dim, int inter) {
    cm::MoeDeviceWeights w;
    w.n_experts = E, w.dim = dim, w.inter = inter;
    return w;
  };
  const cm::MoeGemmPath ST = cm::MoeGemmPath::kStream, TL = cm::MoeGemmPath::kTiled,
                        WS = cm::MoeGemmPath::kTiledWs;
  const cm::MoeDeviceWeights flash = shape(256, 4096, 2048), pro = shape(384, 7168, 3072);
  struct Want {
    int m;
    cm::MoeGemmPath path;
    int tile_n;
  };
  // The stream GEMM up to kStreamAutoMaxRowsPerExpert rows per expert (tile 8 up to 8 tokens
  // and up to kStreamTile8MaxRows rows per expert, else 16): Flash (256 experts, top-6) up to
  // 1365 tokens, Pro (384) up to 2048; the warp-specialised tiled GEMM beyond, its 128 tile up to
  // 159 rows an expert (6784 tokens), 256 from 160 (the plain tiled GEMM's tile by rows: 128
  // there).
  static_assert(cm::kStreamAutoMaxRowsPerExpert == 32, "the token counts below assume 32");
  static_assert(cm::kWsTile256MinRows == 160, "the token counts below assume 160");
  static_assert(cm::kStreamTile8MaxRows == 4, "the token counts below assume 4");
  for (const Want& x :
       {Want{1, ST, 8}, Want{2, ST, 8}, Want{8, ST, 8}, Want{16, ST, 8}, Want{128, ST, 8},
        Want{170, ST, 8}, Want{171, ST, 16}, Want{256, ST, 16}, Want{512, ST, 16},
        Want{1024, ST, 16}, Want{1365, ST, 16}, Want{1366, WS, 128}, Want{2048, WS, 128},
        Want{4096, WS, 128}, Want{6784, WS, 128}, Want{6785, WS, 256}, Want{8192, WS, 256}}) {
    const cm::MoeGemmChoice c = cm::moe_gemm_choice(flash, x.m, 6);
    EXPECT_EQ(c.path, x.path) << "flash m " << x.m;
    EXPECT_EQ(c.tile_n, x.tile_n) << "flash m " << x.m;
    EXPECT_EQ(cm::moe_default_tile_n(flash, x.m, 6), x.tile_n);
  }
  EXPECT_EQ(cm::moe_gemm_choice(pro, 1, 6).path, ST);
  EXPECT_EQ(cm::moe_gemm_choice(pro, 2048, 6).path, ST);
  EXPECT_EQ(cm::moe_gemm_choice(pro, 2049, 6).path, WS);
  EXPECT_EQ(cm::moe_gemm_choice(pro, 256, 6).tile_n, 8);   // 4 rows an expert
  EXPECT_EQ(cm::moe_gemm_choice(pro, 257, 6).tile_n, 16);  // 5
  EXPECT_EQ(cm::moe_gemm_choice(pro, 4096, 6).path, WS);
  // Fewer tokens than experts: rows per expert counts the experts the pairs can reach (a golden
  // set's 16 experts, top-4: 128 tokens are 32 rows each, 129 are 33).
  const cm::MoeDeviceWeights golden = shape(16, 256, 128);
  EXPECT_EQ(cm::moe_gemm_choice(golden, 128, 4).path, ST);
  EXPECT_EQ(cm::moe_gemm_choice(golden, 129, 4).path, WS);
  // A geometry the stream GEMM cannot run (inter not a multiple of 128): the tiled GEMM.
  EXPECT_EQ(cm::moe_gemm_choice(shape(16, 256, 64), 1, 4).path, TL);
  // Forced paths: each path's own tiles (stream: 8 up to 8 tokens or 4 rows an expert, else 16),
  // anything else an error (no fallback).
  EXPECT_EQ(cm::moe_gemm_choice(flash, 8, 6, ST).tile_n, 8);
  EXPECT_EQ(cm::moe_gemm_choice(flash, 9, 6, ST).tile_n, 8);
  EXPECT_EQ(cm::moe_gemm_choice(flash, 171, 6, ST).tile_n, 16);
  EXPECT_EQ(cm::moe_gemm_choice(flash, 4096, 6, ST).tile_n, 16);
  EXPECT_EQ(cm::moe_gemm_choice(flash, 1, 6, TL).tile_n, 8);
  EXPECT_EQ(cm::moe_gemm_choice(flash, 1, 6, TL, 128).tile_n, 128);
  // The 256 tile only when forced (never the heuristic's pick), with its separate quantisation;
  // a geometry its 128 weight rows do not divide is refused.
  EXPECT_EQ(cm::moe_gemm_choice(flash, 8192, 6, TL, 256).tile_n, 256);
  EXPECT_FALSE(cm::moe_gemm_choice(flash, 8192, 6, TL, 256).quant_in_down);
  for (int m : {1, 1366, 8192, 65536})
    EXPECT_EQ(cm::moe_gemm_choice(flash, m, 6, TL).path, TL);  // forced: the plain kernel
  EXPECT_THROW(cm::moe_gemm_choice(shape(16, 192, 64), 1, 4, TL, 256), Error);  // dim 192
  // The warp-specialised tiled GEMM forced: tiles 128 / 256, separate quantisation.
  EXPECT_EQ(cm::moe_gemm_choice(flash, 8192, 6, WS).tile_n, 256);
  EXPECT_EQ(cm::moe_gemm_choice(flash, 8192, 6, WS).path, WS);
  EXPECT_FALSE(cm::moe_gemm_choice(flash, 8192, 6, WS).quant_in_down);
  for (int m : {1, 1365}) EXPECT_NE(cm::moe_gemm_choice(flash, m, 6).path, WS);
  EXPECT_EQ(cm::moe_gemm_choice(flash, 8192, 6, WS, 128).tile_n, 128);
  EXPECT_THROW(cm::moe_gemm_choice(flash, 8192, 6, WS, 64), Error);
  EXPECT_THROW(cm::moe_gemm_choice(flash, 8192, 6, WS, 0, cm::MoeDownQuant::kInDown), Error);
  EXPECT_THROW(cm::moe_gemm_choice(shape(16, 192, 64), 1, 4, WS), Error);
  EXPECT_STREQ(cm::moe_gemm_path_name(WS), "tiled_ws");
  EXPECT_EQ(cm::moe_gemm_choice(flash, 1, 6, cm::MoeGemmPath::kAuto, 32).path, TL);
  EXPECT_THROW(cm::moe_gemm_choice(flash, 1, 6, ST, 32), Error);
  EXPECT_THROW(cm::moe_gemm_choice(flash, 1, 6, TL, 16), Error);
  // The down GEMM's activation quantisation: the stream path's in the GEMM up to
  // kStreamQuantInDownMaxTokens, separate beyond, either when forced; the tiled path's by tile.
  using DQ = cm::MoeDownQuant;
  const int qmax = cm::kStreamQuantInDownMaxTokens;
  if (qmax >= 1) {
    EXPECT_TRUE(cm::moe_fuses_act_quant(cm::moe_gemm_choice(flash, qmax, 6)));
  }
  EXPECT_FALSE(cm::moe_fuses_act_quant(cm::moe_gemm_choice(flash, qmax + 1, 6)));
  EXPECT_EQ(cm::moe_gemm_choice(flash, 1, 6).path, ST);
  EXPECT_FALSE(cm::moe_gemm_choice(flash, 1, 6, ST, 0, DQ::kSeparate).quant_in_down);
  EXPECT_TRUE(cm::moe_gemm_choice(flash, 128, 6, ST, 0, DQ::kInDown).quant_in_down);
  EXPECT_TRUE(cm::moe_fuses_act_quant(cm::moe_gemm_choice(flash, 129, 6, TL)));  // tile 8
  EXPECT_FALSE(cm::moe_fuses_act_quant(cm::moe_gemm_choice(flash, 4096, 6)));
  EXPECT_THROW(cm::moe_gemm_choice(flash, 129, 6, TL, 0, DQ::kSeparate), Error);
  EXPECT_THROW(cm::moe_gemm_choice(flash, 4096, 6, TL, 0, DQ::kInDown), Error);
  EXPECT_TRUE(cm::moe_gemm_choice(flash, 4096, 6, TL, 0, DQ::kSeparate).tile_n == 128);
}

// ---- GPU tests --------------------------------------------------------------------------------

struct Spec {
  std::string name;
  int dim, inter, E, K;
  ExpertFormat fmt;
  bool hash = false;
  int m = 1;
  int skew = 0;         // 1: every token on expert 3 and experts >= E/2 never chosen
  int tile_n = 0;       // 0: the heuristic
  bool direct = false;  // draw FP4 codes directly (large shapes)
  int mx_shift = 0;
  cm::MoeGemmPath path = cm::MoeGemmPath::kAuto;  // expert GEMM path (kAuto: the heuristic)
  ScoreFunc score = ScoreFunc::kSqrtSoftplus;
  cm::MoeDownQuant quant = cm::MoeDownQuant::kAuto;  // where the down activations are quantised
  int ctas = 0;  // the expert GEMMs' grid cap (MoeArgs::gemm_ctas): many items a CTA
};

// The stream path with the down GEMM's activation quantisation placed one way.
Spec separate_quant(Spec s) {
  s.path = cm::MoeGemmPath::kStream;
  s.quant = cm::MoeDownQuant::kSeparate;
  return s;
}
Spec quant_in_down(Spec s) {
  s.path = cm::MoeGemmPath::kStream;
  s.quant = cm::MoeDownQuant::kInDown;
  return s;
}

// The warp-specialised tiled GEMM (its 256 tile), optionally on a few CTAs.
Spec tiled_ws(Spec s, int ctas = 0) {
  s.path = cm::MoeGemmPath::kTiledWs;
  s.ctas = ctas;
  return s;
}
Spec on_ctas(Spec s, int ctas) {
  s.ctas = ctas;
  return s;
}

Spec sigmoid(Spec s) {
  s.score = ScoreFunc::kSigmoid;
  return s;
}

std::ostream& operator<<(std::ostream& os, const Spec& s) {
  return os << s.name;
}

constexpr int kVocab = 97;
constexpr float kRouteScale = 1.5f, kLimit = 10.0f;

struct Layer {
  Spec s;
  HostTensors h;
  MoeRef ref;
  cpu::MoeWeights cpu;
  cpu::MoeParams p;
  cm::MoeDeviceWeights dev;
};

std::unique_ptr<Layer> make_layer(const Spec& s, uint32_t seed) {
  auto L = std::make_unique<Layer>();
  L->s = s;
  std::mt19937 rng(seed);
  const int dim = s.dim, inter = s.inter, E = s.E;
  std::vector<float> gate = gaussian(size_t(E) * dim, 1.0f / std::sqrt(float(dim)), rng);
  L->ref.gate = L->h.add("gate", DType::kBF16, {E, dim}, as_bytes(to_bf16_bits(gate)));
  L->cpu.gate = cpu::Linear::from_rows(cpu::LinearKind::kF32, E, dim, gate);
  if (s.hash) {
    std::vector<int32_t> ids(size_t(kVocab) * s.K);
    for (int t = 0; t < kVocab; ++t)
      for (int i = 0; i < s.K; ++i) {
        int e = int(rng() % E);
        if (t % 5 == 0 && i == 1) e = ids[size_t(t) * s.K];  // a row listing one expert twice
        ids[size_t(t) * s.K + i] = e;
      }
    L->ref.tid2eid = L->h.add("tid2eid", DType::kI32, {kVocab, s.K}, as_bytes(ids));
    L->cpu.tid2eid = ids;
  } else {
    std::vector<float> bias = gaussian(E, 0.05f, rng, false);
    if (s.skew) {
      bias[3] = 100.0f;
      for (int e = E / 2; e < E; ++e) bias[e] = -100.0f;
    }
    L->ref.bias = L->h.add("bias", DType::kF32, {E}, as_bytes(bias));
    L->cpu.bias = bias;
  }
  const float s13 = 4.0f / std::sqrt(float(dim)), s2 = 0.2f / std::sqrt(float(inter));
  for (int e = 0; e < E; ++e) {
    const std::string p = "experts." + std::to_string(e) + ".";
    float g13 = 0, g2 = 0;
    if (s.fmt == ExpertFormat::kNvfp4) {  // ModelOpt: w1/w3 share scale_2 (max amax / 2688)
      g13 = s13 * 4.5f / 2688.0f * 1.0731f;
      g2 = s2 * 4.5f / 2688.0f * 0.9377f;
    }
    ExpertRef x;
    x.w1 = make_fp4(L->h, p + "w1", s.fmt, inter, dim, s13, g13, s.direct, s.mx_shift, rng);
    x.w3 = make_fp4(L->h, p + "w3", s.fmt, inter, dim, s13, g13, s.direct, s.mx_shift, rng);
    x.w2 = make_fp4(L->h, p + "w2", s.fmt, dim, inter, s2, g2, s.direct, s.mx_shift, rng);
    L->ref.experts.push_back(x);
    auto lin = [](const Fp4Ref& r) {
      return cpu::Linear::from_rows(cpu::LinearKind::kFp4, int(r.weight->shape[0]),
                                    int(r.weight->shape[1] * 2), cpu::dequant_fp4(r));
    };
    L->cpu.experts.push_back({lin(x.w1), lin(x.w2), lin(x.w3)});
  }
  const int si = 128;  // the shared expert only feeds its output in
  L->cpu.shared.w1 =
      cpu::Linear::from_rows(cpu::LinearKind::kFp8, si, dim, gaussian(size_t(si) * dim, s13, rng));
  L->cpu.shared.w3 =
      cpu::Linear::from_rows(cpu::LinearKind::kFp8, si, dim, gaussian(size_t(si) * dim, s13, rng));
  L->cpu.shared.w2 =
      cpu::Linear::from_rows(cpu::LinearKind::kFp8, dim, si, gaussian(size_t(dim) * si, s2, rng));
  L->p = {s.K, s.score, kRouteScale, kLimit};
  L->dev = cm::upload_moe_weights(L->ref);
  return L;
}

// What the GPU left in its output and workspace.
struct GpuOut {
  int pairs = 0, tiles = 0, flags = 0, tile_n = 0;
  cm::MoeGemmPath path = cm::MoeGemmPath::kAuto;
  bool quant_in_down = true;
  std::vector<float> y, xq, act, actq, ye, wt, sorted_wt, logits, scores;
  std::vector<int32_t> sel, pair_pos, sorted_row, expert_first, tiles4;
};

// The routing outputs and the grouping from a workspace after moe_forward of m rows.
void fetch_route(const cm::MoeDeviceWeights& dev, int m, int K, const void* ws, GpuOut& o) {
  const cm::MoeWorkspace w = cm::carve_moe_workspace(dev, m, K, const_cast<void*>(ws));
  const std::vector<int32_t> cnt = fetch(w.counters, 3);
  o.pairs = cnt[0], o.tiles = cnt[1], o.flags = cnt[2];
  const size_t P = size_t(std::clamp(o.pairs, 0, m * K)), E = size_t(dev.n_experts);
  o.logits = fetch(w.logits, size_t(m) * E);
  o.scores = fetch(w.scores, size_t(m) * E);
  o.xq = fetch_bf16(w.xq, size_t(m) * dev.dim);
  o.sel = fetch(w.sel, size_t(m) * K);
  o.wt = fetch(w.wt, size_t(m) * K);
  o.pair_pos = fetch(w.pair_pos, size_t(m) * K);
  o.sorted_row = fetch(w.sorted_row, P);
  o.sorted_wt = fetch(w.sorted_wt, P);
  o.expert_first = fetch(w.expert_first, E + 1);
  o.tiles4 =
      fetch(reinterpret_cast<const int32_t*>(w.tiles), 4 * size_t(std::clamp(o.tiles, 0, m * K)));
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
};

GpuOut run_gpu(const Layer& L, const std::vector<float>& x, const std::vector<int32_t>& tokens,
               const std::vector<float>& shared, bool pdl = true) {
  const int m = L.s.m, dim = L.s.dim, K = L.s.K;
  cuda::DeviceBuffer<uint16_t> dx(to_bf16_bits(x)), dsh(to_bf16_bits(shared)), dy(size_t(m) * dim);
  cuda::DeviceBuffer<int32_t> dtok(tokens);
  const size_t bytes = cm::moe_workspace_bytes(L.dev, m, K);
  cuda::DeviceBuffer<uint8_t> ws(bytes);
  ws.fill_bytes(0xff);  // poison: NaN BF16/fp32, -1 ints
  dy.fill_bytes(0xff);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());  // the fills run on the legacy stream
  cm::MoeArgs a;
  a.x = reinterpret_cast<const __nv_bfloat16*>(dx.data());
  a.tokens = L.s.hash ? dtok.data() : nullptr;
  a.shared = reinterpret_cast<const __nv_bfloat16*>(dsh.data());
  a.y = reinterpret_cast<__nv_bfloat16*>(dy.data());
  a.m = m;
  a.p = {K, L.s.score, kRouteScale, kLimit};
  a.workspace = ws.data();
  a.workspace_bytes = bytes;
  a.tile_n = L.s.tile_n;
  a.gemm_path = L.s.path;
  a.down_quant = L.s.quant;
  a.gemm_ctas = L.s.ctas;
  a.pdl = pdl;
  Stream st;
  a.stream = st.s;
  cm::moe_forward(L.dev, a);
  DSV4_CUDA_CHECK(cudaGetLastError());
  DSV4_CUDA_CHECK(cudaStreamSynchronize(st.s));
  const cm::MoeWorkspace w = cm::carve_moe_workspace(L.dev, m, K, ws.data());
  GpuOut o;
  const cm::MoeGemmChoice gc = cm::moe_gemm_choice(L.dev, m, K, L.s.path, L.s.tile_n, L.s.quant);
  o.tile_n = gc.tile_n;
  o.path = gc.path;
  o.quant_in_down = gc.quant_in_down;
  fetch_route(L.dev, m, K, ws.data(), o);
  const size_t P = size_t(std::clamp(o.pairs, 0, m * K));
  o.y = from_bf16_bits(dy.download());
  o.act = fetch_bf16(w.act, P * L.s.inter);
  o.actq = fetch_bf16(w.actq, P * L.s.inter);
  o.ye = fetch_bf16(w.ye, P * dim);
  return o;
}

// relative L2 and the share of elements within one BF16 ulp of the reference.
struct Closeness {
  double rel_l2 = 0, within_ulp = 1;
  size_t n = 0, worst = 0;
  double worst_err = 0, max_ref = 0;  // largest |gpu - cpu| (1e300 for a non-finite) and |cpu|
  std::string first_bad;
};

double bf16_ulp(float v) {
  const float a = std::fabs(v);
  if (a == 0 || !std::isfinite(a)) return std::ldexp(1.0, -133);
  int e;
  std::frexp(a, &e);
  return std::max(std::ldexp(1.0, e - 8), std::ldexp(1.0, -133));
}

Closeness closeness(const std::vector<float>& got, const std::vector<float>& want,
                    const std::vector<char>* skip = nullptr, size_t row_len = 1) {
  Closeness c;
  double num = 0, den = 0;
  size_t ok = 0;
  double worst_err = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    if (skip && (*skip)[i / row_len]) continue;
    ++c.n;
    const double d = double(got[i]) - want[i];
    num += d * d;
    den += double(want[i]) * want[i];
    const bool in = std::fabs(d) <= bf16_ulp(std::max(std::fabs(got[i]), std::fabs(want[i])));
    ok += in;
    if (!std::isfinite(got[i]) || std::fabs(d) > worst_err)
      worst_err = std::isfinite(d) ? std::fabs(d) : 1e300, c.worst = i;
    c.max_ref = std::max(c.max_ref, double(std::fabs(want[i])));
    if (!in && c.first_bad.empty())
      c.first_bad = cat("first element beyond 1 ulp: [", i, "] gpu ", got[i], " cpu ", want[i]);
  }
  c.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (!std::isfinite(c.rel_l2)) c.rel_l2 = 1e300;
  c.within_ulp = c.n ? double(ok) / c.n : 1;
  c.worst_err = std::max(worst_err, 0.0);
  return c;
}

// max_ulps_of_max > 0 also bounds the worst element: |gpu - cpu| <= that many BF16 ulps of the
// largest |cpu| value. For a GEMM stage fed identical inputs the two differ only in fp32
// summation order and final rounding (<= 1 ulp of an element); a few corrupted elements -- a
// race, a wrong scale for one K block -- can hide under the aggregate bounds, not under this.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what,
                  const std::vector<char>* skip = nullptr, size_t row_len = 1,
                  int max_ulps_of_max = 0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const Closeness c = closeness(got, want, skip, row_len);
  const std::string msg =
      cat(what, ": n ", c.n, ", rel L2 ", c.rel_l2, ", within 1 ulp ", 100 * c.within_ulp,
          " %, worst [", c.worst, "] gpu ", got[c.worst], " cpu ", want[c.worst], " (max |cpu| ",
          c.max_ref, "); ", c.first_bad);
  EXPECT_LE(c.rel_l2, 4e-3) << msg;
  EXPECT_GE(c.within_ulp, 0.99) << msg;
  if (max_ulps_of_max > 0) {
    EXPECT_LE(c.worst_err, max_ulps_of_max * bf16_ulp(float(c.max_ref)))
        << msg << " -- worst error beyond " << max_ulps_of_max << " ulps of max |cpu|";
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

uint32_t f32_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

// The CPU op's routing of m rows: logits (cpu::linear of the gate), scores (cpu::moe_score),
// selections and weights (cpu::moe_route).
struct CpuRoute {
  std::vector<float> logits, scores, wt;
  std::vector<int32_t> sel;
};

CpuRoute cpu_route(const cpu::MoeWeights& cw, const cpu::MoeParams& p, int m,
                   const std::vector<float>& x, const std::vector<int32_t>& tokens) {
  const int E = cw.gate.out, dim = cw.gate.in, K = p.top_k;
  CpuRoute c;
  c.logits.resize(size_t(m) * E);
  cpu::linear(cw.gate, x.data(), m, c.logits.data());
  c.scores.resize(c.logits.size());
  for (size_t i = 0; i < c.logits.size(); ++i)
    c.scores[i] = cpu::moe_score(p.score_func, c.logits[i]);
  c.sel.resize(size_t(m) * K);
  c.wt.resize(size_t(m) * K);
  for (int r = 0; r < m; ++r)
    cpu::moe_route(cw, p, x.data() + size_t(r) * dim, tokens[r], c.sel.data() + size_t(r) * K,
                   c.wt.data() + size_t(r) * K);
  return c;
}

// The GPU's routing against the CPU op's, exactly: logits, scores, the selected experts in
// selection order (ties to the lower index) and the weights, bit for bit. The GPU adds the exact
// products in fp64 in another order than the CPU: the two logits round to different fp32 values
// only where the two fp64 sums straddle an fp32 rounding boundary (~1e-7 per logit), so a
// mismatch here is a bug.
void expect_route(const CpuRoute& c, const GpuOut& g, int E, int K, const std::string& what) {
  ASSERT_EQ(g.logits.size(), c.logits.size()) << what;
  size_t bad_logit = 0, bad_score = 0, fl = 0, fs = 0;
  for (size_t i = 0; i < c.logits.size(); ++i) {
    if (f32_bits(g.logits[i]) != f32_bits(c.logits[i]) && bad_logit++ == 0) fl = i;
    if (f32_bits(g.scores[i]) != f32_bits(c.scores[i]) && bad_score++ == 0) fs = i;
  }
  EXPECT_EQ(bad_logit, 0u) << what << ": logits differ; first [row " << fl / E << ", expert "
                           << fl % E << "] gpu " << g.logits[fl] << " cpu " << c.logits[fl];
  EXPECT_EQ(bad_score, 0u) << what << ": scores differ; first [row " << fs / E << ", expert "
                           << fs % E << "] gpu " << g.scores[fs] << " cpu " << c.scores[fs];
  int bad_rows = 0;
  const size_t m = c.sel.size() / size_t(K);
  for (size_t r = 0; r < m; ++r)
    for (int i = 0; i < K; ++i) {
      const size_t j = r * K + i;
      if (g.sel[j] != c.sel[j] || f32_bits(g.wt[j]) != f32_bits(c.wt[j])) {
        if (bad_rows++ < 5)
          ADD_FAILURE() << what << ": row " << r << " slot " << i << ": gpu expert " << g.sel[j]
                        << " weight " << g.wt[j] << ", cpu expert " << c.sel[j] << " weight "
                        << c.wt[j];
        break;
      }
    }
  EXPECT_EQ(bad_rows, 0) << what << ": rows routed differently from cpu::moe_route";
}

// The grouping of the GPU's own selection: unique (row, expert) pairs, per-expert ranges, the
// pair -> position map, tiles covering every position once. cnt: rows per expert.
void check_grouping(const GpuOut& g, int m, int K, int E, std::vector<int>& cnt) {
  cnt.assign(E, 0);
  int pairs = 0;
  for (int r = 0; r < m; ++r)
    for (int i = 0; i < K; ++i) {
      const int e = g.sel[size_t(r) * K + i];
      bool dup = false;
      for (int j = 0; j < i; ++j) dup |= g.sel[size_t(r) * K + j] == e;
      ASSERT_TRUE(e >= 0 && e < E) << "row " << r << " slot " << i << ": expert id " << e;
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
  int want_tiles = 0;
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(g.expert_first[e + 1] - g.expert_first[e], cnt[e]) << "expert " << e;
    want_tiles += (cnt[e] + g.tile_n - 1) / g.tile_n;
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
}

class MoeCuda : public ::testing::TestWithParam<Spec> {
 protected:
  void SetUp() override { DSV4_SKIP_WITHOUT_GPU(); }
};

// Runs one layer on both backends and compares every stage.
void check_layer(const Spec& s, uint32_t seed) {
  auto L = make_layer(s, seed);
  std::mt19937 rng(seed + 1000);
  const int m = s.m, dim = s.dim, K = s.K, E = s.E, inter = s.inter;
  const std::vector<float> x = gaussian(size_t(m) * dim, 1.0f, rng);
  std::vector<int32_t> tokens(m);
  for (int r = 0; r < m; ++r) tokens[r] = s.skew && s.hash ? 7 : int(rng() % kVocab);
  std::vector<float> shared(size_t(m) * dim);
  cpu::expert_forward(L->cpu.shared, kLimit, x.data(), m, nullptr, shared.data());

  const GpuOut g = run_gpu(*L, x, tokens, shared);
  std::printf("[%s] m %d, %s GEMM, tile_n %d, down quantisation %s, unique pairs %d, tiles %d\n",
              s.name.c_str(), m, cm::moe_gemm_path_name(g.path), g.tile_n,
              g.quant_in_down ? "in the GEMM" : "separate", g.pairs, g.tiles);
  if (s.path != cm::MoeGemmPath::kAuto) {
    EXPECT_EQ(g.path, s.path) << "forced GEMM path";
  }
  EXPECT_EQ(g.flags, 0) << "device error flags";

  expect_route(cpu_route(L->cpu, L->p, m, x, tokens), g, E, K, "routing");
  if (::testing::Test::HasFatalFailure()) return;

  // x quantisation: bytes identical.
  std::vector<float> xq_ref(x.size());
  for (int r = 0; r < m; ++r)
    cpu::fake_quant_fp8(x.data() + size_t(r) * dim, dim, 128, xq_ref.data() + size_t(r) * dim);
  expect_bits_equal(g.xq, xq_ref, "x quantisation");

  std::vector<int> cnt;
  check_grouping(g, m, K, E, cnt);
  if (::testing::Test::HasFatalFailure()) return;
  const int pairs = g.pairs;
  if (s.skew && !s.hash) {
    EXPECT_EQ(cnt[3], m) << "every token on expert 3";
    for (int e = E / 2; e < E; ++e) EXPECT_EQ(cnt[e], 0) << "expert " << e << " must get no token";
  }

  // Gate/up GEMM + SwiGLU per expert, from the same quantised x (cpu::linear re-quantises
  // identically) and the GPU's grouping.
  std::vector<float> act_ref(size_t(pairs) * inter), ye_ref(size_t(pairs) * dim);
  std::vector<float> actq_ref(size_t(pairs) * inter);
  for (int e = 0; e < E; ++e) {
    const int f = g.expert_first[e], n = cnt[e];
    if (!n) continue;
    std::vector<float> xe(size_t(n) * dim), ge(size_t(n) * inter), ue(size_t(n) * inter);
    for (int j = 0; j < n; ++j)
      std::copy_n(x.data() + size_t(g.sorted_row[f + j]) * dim, dim, xe.data() + size_t(j) * dim);
    cpu::linear(L->cpu.experts[e].w1, xe.data(), n, ge.data());
    cpu::linear(L->cpu.experts[e].w3, xe.data(), n, ue.data());
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
    // Down GEMM from the GPU's own quantised activations.
    for (int j = 0; j < n; ++j)
      cpu::fake_quant_fp8(g.act.data() + size_t(f + j) * inter, inter, 128,
                          actq_ref.data() + size_t(f + j) * inter);
    cpu::linear(L->cpu.experts[e].w2, g.actq.data() + size_t(f) * inter, n,
                ye_ref.data() + size_t(f) * dim);
  }
  expect_close(g.act, act_ref, "gate/up GEMM + SwiGLU", nullptr, 1, 4);
  expect_bits_equal(g.actq, actq_ref, "act quantisation");
  expect_close(g.ye, ye_ref, "down GEMM", nullptr, 1, 4);

  // Combine: exact from the GPU's expert outputs (fp32 sum in ascending expert index).
  std::vector<float> y_comb(size_t(m) * dim);
  for (int r = 0; r < m; ++r) {
    std::vector<int> order(K);
    std::iota(order.begin(), order.end(), 0);
    const int32_t* sr = g.sel.data() + size_t(r) * K;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return sr[a] < sr[b]; });
    for (int d = 0; d < dim; ++d) {
      float acc = 0.0f;
      for (int i : order) {
        const int pos = g.pair_pos[size_t(r) * K + i];
        if (pos >= 0) acc += g.ye[size_t(pos) * dim + d];
      }
      y_comb[size_t(r) * dim + d] = round_bf16(acc + shared[size_t(r) * dim + d]);
    }
  }
  expect_bits_equal(g.y, y_comb, "combine");

  // The layer against cpu::moe_forward (rows with near-tie selection flips excluded).
  std::vector<float> y_ref(size_t(m) * dim);
  cpu::moe_forward(L->cpu, L->p, x.data(), tokens.data(), m, dim, y_ref.data());
  expect_close(g.y, y_ref, "MoE layer vs cpu::moe_forward");
}

TEST_P(MoeCuda, StagesMatchCpu) {
  check_layer(GetParam(), 1234 + GetParam().m);
}

const ExpertFormat MX = ExpertFormat::kMxfp4, NV = ExpertFormat::kNvfp4;

std::vector<Spec> specs() {
  std::vector<Spec> v;
  // Tiny Flash-like layer (dim 256, inter 128, 16 experts, top-4), every M of the issue.
  for (int m : {1, 3, 17, 63, 65, 1000}) {
    v.push_back({"tiny_mx_score_m" + std::to_string(m), 256, 128, 16, 4, MX, false, m});
    v.push_back({"tiny_nv_score_m" + std::to_string(m), 256, 128, 16, 4, NV, false, m});
  }
  for (int m : {1, 17, 1000})
    v.push_back({"tiny_mx_hash_m" + std::to_string(m), 256, 128, 16, 4, MX, true, m});
  for (int m : {3, 65})
    v.push_back({"tiny_nv_hash_m" + std::to_string(m), 256, 128, 16, 4, NV, true, m});
  // Odd-but-legal sizes: dim 384, inter 384 (3 x 128), 24 experts, top-6.
  v.push_back({"odd_mx_score_m17", 384, 384, 24, 6, MX, false, 17});
  v.push_back({"odd_mx_score_m1000", 384, 384, 24, 6, MX, false, 1000});
  v.push_back({"odd_nv_score_m63", 384, 384, 24, 6, NV, false, 63});
  v.push_back({"odd_nv_hash_m65", 384, 384, 24, 6, NV, true, 65});
  // The sigmoid router (scores and normalised weights; hash layers weight by sigmoid too) at
  // several token counts: the fused decode path (m <= 32) and the split one; the last at the
  // custom config's MoE (dim 128, 8 experts, top-2).
  for (int m : {1, 3, 17, 65, 1000})
    v.push_back(sigmoid({"sigmoid_mx_m" + std::to_string(m), 256, 128, 16, 4, MX, false, m}));
  v.push_back(sigmoid({"sigmoid_nv_m63", 384, 384, 24, 6, NV, false, 63}));
  v.push_back(sigmoid({"sigmoid_nv_hash_m17", 256, 128, 16, 4, NV, true, 17}));
  v.push_back(sigmoid({"sigmoid_skew_nv_m65", 256, 128, 16, 4, NV, false, 65, 1}));
  for (int m : {1, 40})
    v.push_back(sigmoid({"sigmoid_custom_mx_m" + std::to_string(m), 128, 128, 8, 2, MX, false, m}));
  // Skew: all tokens on one expert, half the experts without tokens; hash rows all alike.
  v.push_back({"skew_mx_m65", 256, 128, 16, 4, MX, false, 65, 1});
  v.push_back({"skew_nv_m1000", 256, 128, 16, 4, NV, false, 1000, 1});
  v.push_back({"skew_mx_hash_m65", 256, 128, 16, 4, MX, true, 65, 1});
  // Every token tile (kernel instance), partial tiles everywhere (65 rows on expert 3).
  for (int t : {8, 32, 64, 128, 256}) {
    v.push_back({"tile" + std::to_string(t) + "_mx_m65", 256, 128, 16, 4, MX, false, 65, 1, t});
    v.push_back({"tile" + std::to_string(t) + "_nv_m65", 256, 128, 16, 4, NV, false, 65, 1, t});
  }
  // The 128 tile at every MMA width (N = 32, 64, 96, 128 by the rows of each tile).
  v.push_back({"tile128_mx_m300", 256, 128, 16, 4, MX, false, 300, 1, 128});
  // The 256 tile at every MMA width (N = 64 .. 256: 300 rows on expert 3 = 256 + 44, the other
  // 900 pairs over experts 0-7) and the same for NVFP4 (its second scale word per k16 pair).
  v.push_back({"tile256_mx_m300", 256, 128, 16, 4, MX, false, 300, 1, 256});
  v.push_back({"tile256_nv_m300", 256, 128, 16, 4, NV, false, 300, 1, 256});
  // The warp-specialised 256 tile: every width, and on 3 CTAs (~13 items a CTA: its stage ring
  // runs on across items; the down GEMM's K of 128 is one stage an item) beside the plain tiled
  // kernel on 3 CTAs.
  v.push_back(tiled_ws({"ws256_mx_m300", 256, 128, 16, 4, MX, false, 300, 1, 256}));
  v.push_back(tiled_ws({"ws256_nv_m300", 256, 128, 16, 4, NV, false, 300, 1, 256}));
  v.push_back(tiled_ws({"ws256_nv_m65", 256, 128, 16, 4, NV, false, 65, 1, 256}));
  v.push_back(tiled_ws({"ws128_nv_m300", 256, 128, 16, 4, NV, false, 300, 1, 128}));
  v.push_back(tiled_ws({"ws128_mx_m1000_ctas3", 256, 128, 16, 4, MX, false, 1000, 0, 128}, 3));
  v.push_back(tiled_ws({"ws256_nv_m1000_ctas3", 256, 128, 16, 4, NV, false, 1000}, 3));
  v.push_back(tiled_ws({"ws256_mx_m1000_ctas3", 256, 128, 16, 4, MX, false, 1000}, 3));
  v.push_back(on_ctas({"tile256_nv_m1000_ctas3", 256, 128, 16, 4, NV, false, 1000, 0, 256}, 3));
  v.push_back(on_ctas({"tile128_nv_m1000_ctas3", 256, 128, 16, 4, NV, false, 1000, 0, 128}, 3));
  // The grouping over many CTAs (kPlanMultiMinPairs pairs and more): a partial last chunk,
  // 256 experts, all tokens on one expert, hash routing.
  v.push_back({"plan_multi_nv_m2100", 256, 128, 16, 4, NV, false, 2100});
  v.push_back({"plan_multi_e256_mx_m1400", 256, 128, 256, 6, MX, false, 1400});
  v.push_back({"plan_multi_skew_nv_m2100", 256, 128, 16, 4, NV, false, 2100, 1});
  v.push_back({"plan_multi_hash_mx_m2100", 256, 128, 16, 4, MX, true, 2100});
  // Enough activation blocks (33,000 of 128) for quant_rows' deep loads (kQuantRowsDeepItems).
  v.push_back({"deep_quant_nv_m825", 256, 1280, 16, 4, NV, false, 825});
  // MXFP4 scales beyond 2^1 (the BF16 scale bias moves off its default).
  v.push_back({"bigscale_mx_m17", 256, 128, 16, 4, MX, false, 17, 0, 0, false, 14});
  // Real sizes: Flash (4096 / 2048, golden-sized 16 experts, top-6), Pro (7168 / 3072).
  v.push_back({"flash_nv_m1", 4096, 2048, 16, 6, NV, false, 1, 0, 0, true});
  v.push_back({"flash_mx_m17", 4096, 2048, 16, 6, MX, false, 17, 0, 0, true});
  v.push_back({"flash_nv_m65", 4096, 2048, 16, 6, NV, false, 65, 0, 0, true});
  v.push_back({"flash_nv_m65_tile128", 4096, 2048, 16, 6, NV, false, 65, 1, 128, true});
  v.push_back({"flash_nv_m130_tile256", 4096, 2048, 16, 6, NV, false, 130, 1, 256, true});
  v.push_back(tiled_ws({"flash_nv_m130_ws256", 4096, 2048, 16, 6, NV, false, 130, 1, 256, true}));
  v.push_back(tiled_ws({"flash_mx_m200_ws128", 4096, 2048, 16, 6, MX, false, 200, 1, 128, true}));
  v.push_back({"pro_nv_m3", 7168, 3072, 8, 6, NV, false, 3, 0, 0, true});
  v.push_back({"pro_mx_hash_m4", 7168, 3072, 8, 6, MX, true, 4, 0, 0, true});

  // The stream (decode) expert GEMM, forced: every decode M with the real expert counts and
  // top-k (Flash 256, Pro 384, top-6; small dims so the CPU reference stays cheap); many items
  // per CTA, so the persistent ring wraps across items many times.
  const cm::MoeGemmPath ST = cm::MoeGemmPath::kStream, TL = cm::MoeGemmPath::kTiled;
  for (int m : {1, 2, 7, 16}) {
    const std::string ms = std::to_string(m);
    v.push_back({"stream_e256_nv_m" + ms, 256, 128, 256, 6, NV, false, m, 0, 0, false, 0, ST});
    v.push_back({"stream_e256_mx_m" + ms, 256, 128, 256, 6, MX, false, m, 0, 0, false, 0, ST});
    v.push_back({"stream_e384_nv_m" + ms, 256, 128, 384, 6, NV, false, m, 0, 0, false, 0, ST});
    v.push_back({"stream_e384_mx_m" + ms, 256, 128, 384, 6, MX, false, m, 0, 0, false, 0, ST});
  }
  v.push_back({"stream_e256_mx_hash_m7", 256, 128, 256, 6, MX, true, 7, 0, 0, false, 0, ST});
  v.push_back({"stream_e256_nv_hash_m16", 256, 128, 256, 6, NV, true, 16, 0, 0, false, 0, ST});
  // K of 3 x 128 (a last stage with one 128 block: warpgroup 1 idles there), 6 row blocks of
  // gate/up; both tiles.
  v.push_back({"stream_odd_nv_m7", 384, 384, 24, 6, NV, false, 7, 0, 0, false, 0, ST});
  v.push_back({"stream_odd_mx_m16", 384, 384, 24, 6, MX, false, 16, 0, 0, false, 0, ST});
  // Several tiles per expert (65 rows on expert 3): full and partial tiles of 8 and 16.
  v.push_back({"stream8_mx_m65", 256, 128, 16, 4, MX, false, 65, 1, 8, false, 0, ST});
  v.push_back({"stream16_nv_m65", 256, 128, 16, 4, NV, false, 65, 1, 16, false, 0, ST});
  v.push_back({"stream_bigscale_mx_m17", 256, 128, 16, 4, MX, false, 17, 0, 0, false, 14, ST});
  // Real dims (Flash, Pro) on the stream path, and the tiled path kept at decode M.
  v.push_back({"stream_flash_mx_m2", 4096, 2048, 16, 6, MX, false, 2, 0, 0, true, 0, ST});
  v.push_back({"stream_flash_nv_m16", 4096, 2048, 16, 6, NV, false, 16, 0, 0, true, 0, ST});
  v.push_back({"stream_pro_nv_m7", 7168, 3072, 8, 6, NV, false, 7, 0, 0, true, 0, ST});
  v.push_back({"tiled_flash_nv_m1", 4096, 2048, 16, 6, NV, false, 1, 0, 0, true, 0, TL});
  v.push_back({"tiled_e256_mx_m16", 256, 128, 256, 6, MX, false, 16, 0, 0, false, 0, TL});
  // The stream path's down GEMM quantising its own activations beyond
  // kStreamQuantInDownMaxTokens (forced), and on separately quantised ones (kAuto beyond it):
  // forced at one token, and the heuristic's.
  for (const Spec& s : {Spec{"streamq_e256_nv_m7", 256, 128, 256, 6, NV, false, 7},
                        Spec{"streamq_e384_mx_m16", 256, 128, 384, 6, MX, false, 16},
                        Spec{"streamq_odd_nv_m7", 384, 384, 24, 6, NV, false, 7},
                        Spec{"streamq_flash_mx_m4", 4096, 2048, 16, 6, MX, false, 4, 0, 0, true}})
    v.push_back(quant_in_down(s));
  for (const Spec& s : {Spec{"streamsq_e256_nv_m1", 256, 128, 256, 6, NV, false, 1},
                        Spec{"streamsq_e384_mx_m7", 256, 128, 384, 6, MX, false, 7},
                        Spec{"streamsq_odd_nv_m16", 384, 384, 24, 6, NV, false, 16}})
    v.push_back(separate_quant(s));
  v.push_back({"stream_auto_e256_nv_m40", 256, 128, 256, 6, NV, false, 40});
  v.push_back({"stream_auto_e256_mx_hash_m128", 256, 128, 256, 6, MX, true, 128});
  v.push_back({"stream_auto16_nv_m65", 256, 128, 16, 4, NV, false, 65, 1});
  v.push_back({"stream_auto_flash_nv_m24", 4096, 2048, 16, 6, NV, false, 24, 0, 0, true});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layers, MoeCuda, ::testing::ValuesIn(specs()),
                         [](const ::testing::TestParamInfo<Spec>& i) { return i.param.name; });

// ---- the router at the real shapes ---------------------------------------------------------
// Routing and grouping alone (stages route + plan, or route only) with Flash's 256 and Pro's 384
// experts at their dims, every decode batch and beyond, every logits kernel forced in turn and
// the heuristic's: the device weights hold only the gate, bias or tid2eid (no experts: the GEMM
// stages do not run). Against the CPU op exactly (expect_route), the x quantisation bytes, the
// grouping, and a second run bit-identical.
struct RouteSpec {
  std::string name;
  int E, dim, K, m;
  bool hash = false;
  ScoreFunc score = ScoreFunc::kSqrtSoftplus;
  bool plan = true;  // route + plan; false: the route stage alone
};

std::ostream& operator<<(std::ostream& os, const RouteSpec& s) {
  return os << s.name;
}

class MoeRouterCuda : public ::testing::TestWithParam<RouteSpec> {
 protected:
  void SetUp() override { DSV4_SKIP_WITHOUT_GPU(); }
};

TEST_P(MoeRouterCuda, MatchesCpuExactly) {
  const RouteSpec& s = GetParam();
  const int E = s.E, dim = s.dim, K = s.K, m = s.m;
  std::mt19937 rng(777 + uint32_t(E) + uint32_t(m) + (s.hash ? 1000u : 0u));
  std::vector<float> gate = gaussian(size_t(E) * dim, 1.0f / std::sqrt(float(dim)), rng);
  std::vector<float> bias = gaussian(E, 0.05f, rng, false);
  // Exact ties: experts 17, 19, ..., 31 copy the gate row and bias of 16, 18, ..., 30; the 16
  // are lifted so they are often among the top-k, where a pair straddling the k-th place
  // must give the lower index.
  const int tied_end = E >= 32 ? 32 : 16;  // no planted ties below 32 experts
  for (int j = 16; j < tied_end; j += 2) {
    std::copy_n(gate.begin() + size_t(j) * dim, dim, gate.begin() + size_t(j + 1) * dim);
    bias[j] += 1.0f;
    bias[j + 1] = bias[j];
  }
  std::vector<int32_t> ids(size_t(kVocab) * K);
  for (int t = 0; t < kVocab; ++t)
    for (int i = 0; i < K; ++i)  // every 5th token lists one expert twice
      ids[size_t(t) * K + i] = t % 5 == 0 && i == 1 ? ids[size_t(t) * K] : int(rng() % E);

  cpu::MoeWeights cw;
  cw.gate = cpu::Linear::from_rows(cpu::LinearKind::kF32, E, dim, gate);
  cm::MoeDeviceWeights dev;
  dev.n_experts = E;
  dev.dim = dim;
  dev.inter = 128;  // only sizes the (unused) GEMM regions of the workspace
  dev.gate = cuda::DeviceBuffer<uint16_t>(to_bf16_bits(gate));
  if (s.hash) {
    cw.tid2eid = ids;
    dev.tid2eid = cuda::DeviceBuffer<int32_t>(ids);
    dev.vocab = kVocab;
    dev.hash_top_k = K;
  } else {
    cw.bias = bias;
    dev.bias = cuda::DeviceBuffer<float>(bias);
  }
  const cpu::MoeParams p{K, s.score, kRouteScale, kLimit};

  const std::vector<float> x = gaussian(size_t(m) * dim, 1.0f, rng);
  std::vector<int32_t> tokens(m);
  for (int r = 0; r < m; ++r) tokens[r] = int(rng() % kVocab);
  cuda::DeviceBuffer<uint16_t> dx(to_bf16_bits(x));
  cuda::DeviceBuffer<int32_t> dtok(tokens);
  cuda::DeviceBuffer<uint16_t> dy(size_t(m) * dim);  // not written: no combine stage
  const size_t bytes = cm::moe_workspace_bytes(dev, m, K);
  auto run = [&](cm::RouterPath path) {
    cuda::DeviceBuffer<uint8_t> ws(bytes);
    ws.fill_bytes(0xff);  // poison: NaN fp32 / BF16, -1 ints
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    cm::MoeArgs a;
    a.x = reinterpret_cast<const __nv_bfloat16*>(dx.data());
    a.tokens = s.hash ? dtok.data() : nullptr;
    a.y = reinterpret_cast<__nv_bfloat16*>(dy.data());
    a.m = m;
    a.p = {K, s.score, kRouteScale, kLimit};
    a.workspace = ws.data();
    a.workspace_bytes = bytes;
    a.stages = cm::kStageRoute | (s.plan ? cm::kStagePlan : 0u);
    a.router_path = path;
    Stream st;
    a.stream = st.s;
    cm::moe_forward(dev, a);
    DSV4_CUDA_CHECK(cudaGetLastError());
    DSV4_CUDA_CHECK(cudaStreamSynchronize(st.s));
    GpuOut g;
    g.tile_n = cm::moe_gemm_choice(dev, m, K).tile_n;
    fetch_route(dev, m, K, ws.data(), g);
    return g;
  };
  const CpuRoute want = cpu_route(cw, p, m, x, tokens);
  std::vector<float> xq_ref(x.size());
  for (int r = 0; r < m; ++r)
    cpu::fake_quant_fp8(x.data() + size_t(r) * dim, dim, 128, xq_ref.data() + size_t(r) * dim);
  // Every logits kernel (the gemv kernel takes up to 256 rows), then the heuristic's choice.
  std::vector<cm::RouterPath> paths = {cm::RouterPath::kMma, cm::RouterPath::kTiled,
                                       cm::RouterPath::kAuto};
  if (m <= 256) paths.insert(paths.begin(), cm::RouterPath::kGemv);
  GpuOut g;
  for (cm::RouterPath path : paths) {
    const std::string what = cat(s.name, " ", cm::router_path_name(path));
    g = run(path);
    std::printf("[%s] E %d, dim %d, top-%d, m %d, %s, %s\n", s.name.c_str(), E, dim, K, m,
                s.plan ? "route + plan" : "route only", cm::router_path_name(path));
    EXPECT_EQ(g.flags, 0) << what << ": device error flags";
    expect_route(want, g, E, K, what);
    expect_bits_equal(g.xq, xq_ref, cat(what, ": x quantisation").c_str());
    if (s.plan) {
      std::vector<int> cnt;
      check_grouping(g, m, K, E, cnt);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  if (!s.hash) {  // the planted ties were exercised: some row selected exactly one of a pair
    int split = 0;
    for (int r = 0; r < m; ++r)
      for (int j = 16; j < tied_end; j += 2) {
        const auto b = g.sel.begin() + size_t(r) * K, e = b + K;
        split += (std::find(b, e, j) != e) != (std::find(b, e, j + 1) != e);
      }
    std::printf("  rows x pairs with one of two tied experts selected: %d\n", split);
  }

  // Run to run (the heuristic's path again): bit-identical, no atomics in any sum.
  const GpuOut h = run(cm::RouterPath::kAuto);
  EXPECT_EQ(std::memcmp(g.logits.data(), h.logits.data(), 4 * g.logits.size()), 0) << "logits";
  EXPECT_EQ(std::memcmp(g.scores.data(), h.scores.data(), 4 * g.scores.size()), 0) << "scores";
  EXPECT_EQ(g.sel, h.sel);
  EXPECT_EQ(std::memcmp(g.wt.data(), h.wt.data(), 4 * g.wt.size()), 0) << "weights";
}

std::vector<RouteSpec> route_specs() {
  std::vector<RouteSpec> v;
  const ScoreFunc SG = ScoreFunc::kSigmoid;
  // Flash (256 experts, dim 4096) and Pro (384, 7168), top-6: the decode batches (one CTA
  // selects and groups up to 32 rows), 128 (the many-CTA selection + plan), 300 (the tiled
  // logits kernel beyond 256 rows); score and hash layers.
  for (int m : {1, 8, 32, 128, 300}) {
    const std::string ms = "_m" + std::to_string(m);
    v.push_back({"flash_score" + ms, 256, 4096, 6, m});
    v.push_back({"pro_score" + ms, 384, 7168, 6, m});
    v.push_back({"flash_hash" + ms, 256, 4096, 6, m, true});
    v.push_back({"pro_hash" + ms, 384, 7168, 6, m, true});
  }
  // Every decode kernel instance (rows 2, 3, 5, 17 of their tiles), the sigmoid router, the
  // route stage alone (the many-CTA selection at decode sizes).
  for (int m : {2, 3, 5, 17}) v.push_back({"flash_score_m" + std::to_string(m), 256, 4096, 6, m});
  v.push_back({"flash_sigmoid_m8", 256, 4096, 6, 8, false, SG});
  v.push_back({"pro_sigmoid_hash_m32", 384, 7168, 6, 32, true, SG});
  v.push_back({"flash_route_only_m8", 256, 4096, 6, 8, false, ScoreFunc::kSqrtSoftplus, false});
  // Small and odd shapes through every kernel: dim 384 (3 x 128: K splits of 96), dim 128 with 8
  // experts and top-2 (the custom config; one 32-wide k-block per cluster CTA), 24 experts.
  v.push_back({"odd_e24_dim384_m17", 24, 384, 6, 17});
  v.push_back({"odd_e24_dim384_hash_m3", 24, 384, 6, 3, true});
  v.push_back({"custom_e8_dim128_m40", 8, 128, 2, 40});
  v.push_back({"custom_e8_dim128_sigmoid_m1", 8, 128, 2, 1, false, SG});
  v.push_back({"pro_route_only_m300", 384, 7168, 6, 300, false, ScoreFunc::kSqrtSoftplus, false});
  // Beyond kRouterAutoMmaRows the heuristic takes the tiled kernel (a partial last row tile).
  v.push_back({"flash_score_m2100", 256, 4096, 6, 2100});
  return v;
}

INSTANTIATE_TEST_SUITE_P(RealShapes, MoeRouterCuda, ::testing::ValuesIn(route_specs()),
                         [](const ::testing::TestParamInfo<RouteSpec>& i) { return i.param.name; });

// A cheap "does it run" check with a one-line result.
class MoeCudaSmoke : public test::GpuTest {};

TEST_F(MoeCudaSmoke, TinyLayerRuns) {
  std::printf("device: %s\n", cuda::describe_device().c_str());
  check_layer({"smoke_mx_m3", 256, 128, 16, 4, MX, false, 3}, 7);
}

// Programmatic dependent launch only overlaps launches: the output is the same without it.
// The quantised down-GEMM input of every (token, slot) pair, in pair order: a pair's position
// in the sorted order (its rank within its expert) comes from an atomic counter, so two runs
// may store an expert's rows in different orders (every output is per pair, so y is not
// affected); -1 slots (a repeated expert) stay zero.
std::vector<float> rows_by_pair(const GpuOut& g, const std::vector<float>& by_pos, int m, int K,
                                int width) {
  std::vector<float> v(size_t(m) * K * width, 0.0f);
  for (int p = 0; p < m * K; ++p) {
    const int pos = g.pair_pos[size_t(p)];
    if (pos < 0) continue;
    std::copy_n(by_pos.data() + size_t(pos) * width, width, v.data() + size_t(p) * width);
  }
  return v;
}
std::vector<float> actq_by_pair(const GpuOut& g, int m, int K, int inter) {
  return rows_by_pair(g, g.actq, m, K, inter);
}

TEST_F(MoeCudaSmoke, SameOutputWithoutPdl) {
  const Spec s{"pdl", 256, 128, 16, 4, NV, false, 65};
  auto L = make_layer(s, 8);
  std::mt19937 rng(5);
  const std::vector<float> x = gaussian(size_t(s.m) * s.dim, 1.0f, rng);
  const std::vector<float> shared = gaussian(size_t(s.m) * s.dim, 0.1f, rng);
  const std::vector<int32_t> tokens(s.m, 0);
  const GpuOut a = run_gpu(*L, x, tokens, shared, true), b = run_gpu(*L, x, tokens, shared, false);
  expect_bits_equal(a.y, b.y, "y with and without PDL");
  expect_bits_equal(a.xq, b.xq, "xq with and without PDL");
  expect_bits_equal(actq_by_pair(a, s.m, s.K, s.inter), actq_by_pair(b, s.m, s.K, s.inter),
                    "each pair's quantised activations with and without PDL");
}

// The warp-specialised tiles run the plain tiled kernel's products in its order: every output of
// both GEMMs bit-identical to it, with the whole grid and on 3 CTAs (many items each), at every
// MMA width (skewed rows), both formats, both tiles.
TEST_F(MoeCudaSmoke, TiledWsEqualsTiled) {
  for (const auto& [f, tile] : {std::pair{NV, 256}, std::pair{MX, 256}, std::pair{MX, 128}}) {
    SCOPED_TRACE(cat(f == NV ? "nvfp4" : "mxfp4", ", tile ", tile));
    auto L = make_layer({"ws_vs_tiled", 256, 128, 16, 4, f, false, 300, 1, tile}, 23);
    std::mt19937 rng(29);
    const std::vector<float> x = gaussian(size_t(L->s.m) * L->s.dim, 1.0f, rng);
    const std::vector<float> shared = gaussian(size_t(L->s.m) * L->s.dim, 0.1f, rng);
    const std::vector<int32_t> tokens(L->s.m, 0);
    const GpuOut ref = run_gpu(*L, x, tokens, shared);
    ASSERT_EQ(ref.path, cm::MoeGemmPath::kTiled);
    for (int ctas : {0, 3}) {
      SCOPED_TRACE(ctas ? "on 3 CTAs" : "on every SM");
      L->s.path = cm::MoeGemmPath::kTiledWs;
      L->s.ctas = ctas;
      const GpuOut ws = run_gpu(*L, x, tokens, shared);
      L->s.path = cm::MoeGemmPath::kTiled;
      L->s.ctas = 0;
      ASSERT_EQ(ws.path, cm::MoeGemmPath::kTiledWs);
      // By pair: an expert's rows may sit in another order in each run (actq_by_pair).
      const int m = L->s.m, K = L->s.K;
      expect_bits_equal(rows_by_pair(ws, ws.act, m, K, L->s.inter),
                        rows_by_pair(ref, ref.act, m, K, L->s.inter), "gate/up + SwiGLU");
      expect_bits_equal(rows_by_pair(ws, ws.ye, m, K, L->s.dim),
                        rows_by_pair(ref, ref.ye, m, K, L->s.dim), "down projections");
      expect_bits_equal(ws.y, ref.y, "y");
    }
  }
}

TEST_F(MoeCudaSmoke, RejectsUnsupported) {
  auto L = make_layer({"reject", 256, 128, 16, 4, MX, false, 3}, 9);
  cm::MoeArgs a;
  a.m = 3;
  a.p = {4, ScoreFunc::kSoftmax, 1, 0};
  EXPECT_THROW(cm::moe_forward(L->dev, a), Error);  // score function
  a.p.score_func = ScoreFunc::kSqrtSoftplus;
  a.p.top_k = 17;
  EXPECT_THROW(cm::moe_forward(L->dev, a), Error);  // top-k beyond the experts
  a.p.top_k = 4;
  EXPECT_THROW(cm::moe_forward(L->dev, a), Error);  // no workspace / pointers
  // GEMM path and tile: a forced choice that does not fit is an error, not a fallback.
  const cm::MoeGemmPath ST = cm::MoeGemmPath::kStream, TL = cm::MoeGemmPath::kTiled;
  EXPECT_THROW(cm::moe_gemm_choice(L->dev, 3, 4, ST, 32), Error);
  EXPECT_THROW(cm::moe_gemm_choice(L->dev, 3, 4, TL, 16), Error);
  EXPECT_EQ(cm::moe_gemm_choice(L->dev, 3, 4, ST, 16).tile_n, 16);
  EXPECT_EQ(cm::moe_gemm_choice(L->dev, 3, 4, cm::MoeGemmPath::kAuto, 8).path, TL);
  // The heuristic: the stream GEMM at decode sizes, the tiled GEMM beyond (moe_heuristic.cpp);
  // the stream GEMM's own tiles.
  EXPECT_EQ(cm::moe_gemm_choice(L->dev, 3, 4).path, ST);
  EXPECT_EQ(cm::moe_gemm_choice(L->dev, 3, 4, ST).tile_n, 8);
  EXPECT_EQ(cm::moe_gemm_choice(L->dev, 9, 4, ST).tile_n, 8);    // 3 rows an expert
  EXPECT_EQ(cm::moe_gemm_choice(L->dev, 17, 4, ST).tile_n, 16);  // 5
  EXPECT_EQ(cm::moe_gemm_choice(L->dev, 1000, 4).path, cm::MoeGemmPath::kTiledWs);  // 250 rows
}

// The stream GEMM path too: the same output with and without programmatic dependent launch.
// Both placements of the down GEMM's activation quantisation.
TEST_F(MoeCudaSmoke, StreamSameOutputWithoutPdl) {
  for (cm::MoeDownQuant q : {cm::MoeDownQuant::kInDown, cm::MoeDownQuant::kSeparate}) {
    SCOPED_TRACE(q == cm::MoeDownQuant::kInDown ? "quantised in the down GEMM" : "separately");
    Spec s{"pdl_stream", 256, 128, 256, 6, MX, false, 7};
    s.path = cm::MoeGemmPath::kStream;
    s.quant = q;
    auto L = make_layer(s, 18);
    std::mt19937 rng(15);
    const std::vector<float> x = gaussian(size_t(s.m) * s.dim, 1.0f, rng);
    const std::vector<float> shared = gaussian(size_t(s.m) * s.dim, 0.1f, rng);
    const std::vector<int32_t> tokens(s.m, 0);
    const GpuOut a = run_gpu(*L, x, tokens, shared, true),
                 b = run_gpu(*L, x, tokens, shared, false);
    expect_bits_equal(a.y, b.y, "y with and without PDL");
    expect_bits_equal(actq_by_pair(a, s.m, s.K, s.inter), actq_by_pair(b, s.m, s.K, s.inter),
                      "each pair's quantised activations with and without PDL");
  }
}

}  // namespace
}  // namespace dsv4
