#include "ops/cuda/moe/fp4_pack.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace dsv4::cuda::moe {
namespace {

// table[j][byte]: the word bits of A register j for a source byte holding two adjacent codes
// (low nibble = element 2k -> low half, high nibble = element 2k+1 -> high half).
std::array<std::array<uint32_t, 256>, 4> make_place_table() {
  std::array<std::array<uint32_t, 256>, 4> t{};
  for (int j = 0; j < 4; ++j)
    for (int b = 0; b < 256; ++b) {
      uint32_t w = 0;
      for (int h = 0; h < 2; ++h) {
        const int code = (b >> (4 * h)) & 0xf;
        for (int f = 0; f < 4; ++f)
          if (code & (1 << f)) w |= 1u << kFieldPos[j][h][f];
      }
      t[j][b] = w;
    }
  return t;
}
const std::array<std::array<uint32_t, 256>, 4> kPlace = make_place_table();

// u5m3 re-encoding of an E4M3 scale magnitude (code without sign, not NaN, not zero).
uint8_t e4m3_to_u5m3(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  if (e != 0) return static_cast<uint8_t>(((e + 3) << 3) | m);
  const int p = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // floor(log2(m)), m in 1..7
  return static_cast<uint8_t>(((p + 1) << 3) | ((m << (3 - p)) & 7));
}

// One source projection as the packer reads it, with the per-tensor constants decided.
struct Source {
  ExpertFormat f;
  int out = 0, in = 0;
  const uint8_t* codes = nullptr;   // [out, in/2]
  const uint8_t* scales = nullptr;  // [out, in/group]
  int group = 32;
  Fp4Scale epi;

  // Source byte of codes (o, 2k), (o, 2k+1) after NVFP4's sign/zero folding.
  uint8_t code_byte(int o, int i) const {
    const uint8_t b = codes[size_t(o) * (in / 2) + i / 2];
    if (f == ExpertFormat::kMxfp4) return b;
    const uint8_t s = scales[size_t(o) * (in / 16) + i / 16];
    if ((s & 0x7f) == 0) return 0;
    return (s & 0x80) ? uint8_t(b ^ 0x88) : b;
  }
  uint8_t scale_byte(int o, int g) const {
    const uint8_t s = scales[size_t(o) * (in / group) + g];
    if (f == ExpertFormat::kMxfp4) return s;
    return (s & 0x7f) == 0 ? 0 : e4m3_to_u5m3(s & 0x7f);
  }
};

// row_multiple: 64 for a projection packed alone, 32 for one half of the gate/up pair.
Source make_source(const Fp4Ref& r, int row_multiple) {
  DSV4_CHECK(r.weight && r.scale, "pack_fp4: missing weight or scale tensor");
  const TensorView& w = *r.weight;
  const TensorView& s = *r.scale;
  DSV4_CHECK(w.dtype == DType::kU8 || w.dtype == DType::kI8, "tensor '", w.name,
             "': FP4 codes must be U8/I8, got ", dtype_name(w.dtype));
  DSV4_CHECK(w.shape.size() == 2, "tensor '", w.name, "': expected [out, in/2], got ",
             shape_str(w.shape));
  Source src;
  src.f = r.format;
  src.out = static_cast<int>(w.shape[0]);
  src.in = static_cast<int>(w.shape[1] * 2);
  src.codes = w.data;
  src.scales = s.data;
  DSV4_CHECK(src.out % row_multiple == 0 && src.in % kPackK == 0, "tensor '", w.name, "': shape [",
             src.out, ", ", src.in, "] is off the CUDA expert GEMM's tile grid (", row_multiple,
             " rows x ", kPackK, ")");
  if (r.format == ExpertFormat::kMxfp4) {
    src.group = 32;
    DSV4_CHECK(s.dtype == DType::kF8E8M0 && s.shape == (std::vector<int64_t>{src.out, src.in / 32}),
               "tensor '", s.name, "': expected F8_E8M0 [", src.out, ", ", src.in / 32, "], got ",
               dtype_name(s.dtype), " ", shape_str(s.shape));
    int bmin = 255, bmax = 0;
    for (int64_t i = 0; i < s.numel(); ++i) {
      const int b = s.data[i];
      DSV4_CHECK(b != 0xff, "tensor '", s.name, "': NaN scale (0xff)");
      bmin = std::min(bmin, b);
      bmax = std::max(bmax, b);
    }
    // The BF16 scale 2^(b + C - 127) must stay normal and every product e2m1 * 2^(b-127) *
    // 2^(C-126) must be a normal BF16: C in [128 - bmin, 254 - bmax]; prefer C = 126 (k = 0).
    const int lo = 128 - bmin, hi = 254 - bmax;
    DSV4_CHECK(lo <= hi, "tensor '", s.name, "': MXFP4 scale exponents span ", bmax - bmin,
               " binades; the CUDA expert GEMM supports at most 126");
    const int c = std::max(lo, std::min(126, hi));
    src.epi.bias = uint32_t(c) * 128u * 0x10001u;
    src.epi.mult = std::ldexp(1.0f, 126 - c);
  } else {
    src.group = 16;
    DSV4_CHECK(s.dtype == DType::kF8E4M3 && s.shape == (std::vector<int64_t>{src.out, src.in / 16}),
               "tensor '", s.name, "': expected F8_E4M3 [", src.out, ", ", src.in / 16, "], got ",
               dtype_name(s.dtype), " ", shape_str(s.shape));
    for (int64_t i = 0; i < s.numel(); ++i)
      DSV4_CHECK((s.data[i] & 0x7f) != 0x7f, "tensor '", s.name, "': NaN block scale");
    DSV4_CHECK(r.scale_2 && r.scale_2->dtype == DType::kF32 && r.scale_2->numel() == 1, "tensor '",
               w.name, "': NVFP4 needs an F32 scalar weight_scale_2");
    float g;
    std::memcpy(&g, r.scale_2->data, 4);
    DSV4_CHECK(std::isfinite(g) && g > 0, "tensor '", r.scale_2->name,
               "': weight_scale_2 must be finite and positive, got ", g);
    src.epi.bias = kNvScaleBias * 0x10001u;
    src.epi.mult = std::ldexp(g, kNvScaleShift);
    DSV4_CHECK(std::isfinite(src.epi.mult), "tensor '", r.scale_2->name,
               "': weight_scale_2 too large");
  }
  return src;
}

// Packs rows [0, rows) where packed row R comes from row_of(R) of srcs[proj_of(R)].
template <typename RowMap>
void pack_rows(const Source* srcs, int rows, int cols, ExpertFormat f, RowMap row_map,
               std::vector<uint8_t>& out) {
  const int tile = pack_tile_bytes(f), kb_count = cols / kPackK;
  out.assign(size_t(rows / kPackRows) * kb_count * tile, 0);
  for (int rb = 0; rb < rows / kPackRows; ++rb)
    for (int kb = 0; kb < kb_count; ++kb) {
      uint8_t* t = out.data() + (size_t(rb) * kb_count + kb) * tile;
      for (int th = 0; th < 128; ++th) {
        const int w = th / 32, l = th % 32;
        int proj[2], row[2];
        for (int h = 0; h < 2; ++h)
          row_map(rb * kPackRows + 16 * w + l / 4 + 8 * h, proj[h], row[h]);
        const Source& s0 = srcs[proj[0]];
        const Source& s1 = srcs[proj[1]];
        for (int kk = 0; kk < 4; ++kk) {
          const int c = kb * kPackK + 16 * kk + 2 * (l % 4);
          const uint32_t word =
              kPlace[0][s0.code_byte(row[0], c)] | kPlace[1][s1.code_byte(row[1], c)] |
              kPlace[2][s0.code_byte(row[0], c + 8)] | kPlace[3][s1.code_byte(row[1], c + 8)];
          std::memcpy(t + 16 * th + 4 * kk, &word, 4);
        }
      }
      uint8_t* sc = t + kPackCodeBytes;
      for (int rp = 0; rp < 32; ++rp) {
        const int w = rp / 8, rlo = rp % 8;
        for (int h = 0; h < 2; ++h) {
          int p, r;
          row_map(rb * kPackRows + 16 * w + rlo + 8 * h, p, r);
          if (f == ExpertFormat::kMxfp4) {
            for (int g = 0; g < 2; ++g) sc[4 * rp + 2 * g + h] = srcs[p].scale_byte(r, kb * 2 + g);
          } else {
            for (int g = 0; g < 4; ++g) sc[8 * rp + 2 * g + h] = srcs[p].scale_byte(r, kb * 4 + g);
          }
        }
      }
    }
}

}  // namespace

PackedFp4 pack_fp4(const Fp4Ref& w) {
  const Source s = make_source(w, kPackRows);
  PackedFp4 p;
  p.format = s.f;
  p.rows = s.out;
  p.cols = s.in;
  p.epi = {s.epi, s.epi};
  pack_rows(
      &s, s.out, s.in, s.f, [](int r, int& proj, int& row) { proj = 0, row = r; }, p.bytes);
  return p;
}

PackedFp4 pack_fp4_gate_up(const Fp4Ref& w1, const Fp4Ref& w3) {
  const Source s[2] = {make_source(w1, kPackRows / 2), make_source(w3, kPackRows / 2)};
  DSV4_CHECK(s[0].f == s[1].f, "tensors '", w1.weight->name, "' and '", w3.weight->name,
             "': gate and up projections must share one FP4 format");
  DSV4_CHECK(s[0].out == s[1].out && s[0].in == s[1].in, "tensors '", w1.weight->name, "' and '",
             w3.weight->name, "': gate and up projections differ in shape");
  PackedFp4 p;
  p.format = s[0].f;
  p.rows = 2 * s[0].out;
  p.cols = s[0].in;
  p.epi = {s[0].epi, s[1].epi};
  pack_rows(
      s, p.rows, p.cols, p.format, [](int r, int& proj, int& row) { gate_up_source(r, proj, row); },
      p.bytes);
  return p;
}

}  // namespace dsv4::cuda::moe
