// Routed-expert FP4 weights (MXFP4 and NVFP4) repacked once at load time into the layout the
// grouped expert GEMM reads: the weight matrix is the wgmma A operand (64 output rows per
// warpgroup, from registers), so every thread's share of a 64x64 tile -- its A fragments for
// four k16 steps -- is one 16-byte word group it loads with a single shared-memory read.
//
// Tile (64 rows x 64 K) = [2048 bytes of codes][scales]:
//  * codes: thread t of the warpgroup (warp w = t/32, lane l) owns bytes [16t, 16t+16), one
//    32-bit word per k16 step kk. Word kk holds the 8 values of the thread's wgmma A fragment
//    (rows r0 = 16w + l/4 and r1 = r0 + 8, columns c = 16kk + 2(l%4) + {0, 1, 8, 9}):
//    register a0 = (r0, c..c+1), a1 = (r1, c..c+1), a2 = (r0, c+8..c+9), a3 = (r1, c+8..c+9),
//    low value in the low BF16 half. Each value's e2m1 fields (m, e0, e1, s) sit at bit
//    positions chosen so that a rotate and a mask turn them into a BF16 pattern whose value
//    is e2m1 * 2^-126 (kFieldPos below; 9 ALU operations per word).
//  * scales, one record per row pair (r0, r1), record index 8w + l/4:
//    MXFP4: 4 bytes [r0 g0, r1 g0, r0 g1, r1 g1], g = 32-wide group (the E8M0 byte as is);
//    NVFP4: 8 bytes [r0 g0, r1 g0, ..., r0 g3, r1 g3], g = 16-wide group, re-encoded "u5m3":
//           byte = E' << 3 | m with |scale| = 2^(E' - 10) * (1 + m/8), E' in [1, 18];
//           0 for a zero scale (its codes are zeroed). A negative E4M3 scale's sign moves
//           into its codes.
// Dequantisation (kernel): BF16 scale S = bits(byte * 128 + bias) (MXFP4) or
// bits(byte * 16 + bias) (NVFP4), per byte in both halves; value = (e2m1 * 2^-126) * S, one
// exact BF16 multiply. The products are e2m1 * scale * 2^-k exactly (both formats' products
// have at most 6 significant bits, BF16 has 8), and the epilogue multiplies the fp32
// accumulator by `mult` = 2^k (MXFP4) or 2^k * scale_2 (NVFP4, k = 7): scale_2 is folded into
// the epilogue, never into the BF16 weights, so the BF16 MMA sees the exact e2m1 * scale.
//
// Tiles of a projection are stored [row block][k block]: the K stream of one 64-row block is
// contiguous. The gate/up pair is packed as one [2*inter, dim] matrix with w1 and w3 rows
// interleaved by 8 (packed rows 16j..16j+7 = w1 rows 8j..8j+7, 16j+8..16j+15 = w3 rows), so
// each thread's accumulators hold g and u of the same intermediate index.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/common/weight_refs.h"

#if defined(__CUDACC__)
#define DSV4_MOE_HD __host__ __device__ __forceinline__
#else
#define DSV4_MOE_HD inline
#endif

namespace dsv4::cuda::moe {

constexpr int kPackRows = 64;
constexpr int kPackK = 64;
constexpr int kPackCodeBytes = kPackRows * kPackK / 2;  // 2048
constexpr int pack_scale_bytes(ExpertFormat f) {
  return f == ExpertFormat::kMxfp4 ? 128 : 256;
}
constexpr int pack_tile_bytes(ExpertFormat f) {
  return kPackCodeBytes + pack_scale_bytes(f);
}
// NVFP4: BF16 exponent bias of the re-encoded scale (S = scale * 2^119, products * 2^-7).
constexpr uint32_t kNvScaleBias = 236u << 7;
constexpr int kNvScaleShift = 7;

// Per projection: the scale-to-BF16 bias (same in both 16-bit halves) and the fp32 multiplier
// the accumulator gets in the epilogue.
struct Fp4Scale {
  uint32_t bias = 0;
  float mult = 1;
};
// a: packed rows r with r % 16 < 8 (w1 of a gate/up pair); b: r % 16 >= 8 (w3). A single
// projection has a == b.
struct Fp4Epilogue {
  Fp4Scale a, b;
};

struct PackedFp4 {
  ExpertFormat format = ExpertFormat::kMxfp4;
  int rows = 0, cols = 0;      // packed matrix [rows, cols] (gate/up: rows = 2 * inter)
  std::vector<uint8_t> bytes;  // (rows/64) * (cols/64) tiles
  Fp4Epilogue epi;
};

// One projection [out, in]: out % 64 == 0, in % 64 == 0. Throws dsv4::Error naming the tensor
// on a bad dtype/shape, a NaN scale, or (MXFP4) scale exponents spanning more than 126 binades.
PackedFp4 pack_fp4(const Fp4Ref& w);
// w1 and w3 [inter, dim] interleaved by 8 rows (inter % 32 == 0); same format required.
PackedFp4 pack_fp4_gate_up(const Fp4Ref& w1, const Fp4Ref& w3);

// ---- layout helpers shared by the packer, the kernels and the tests ----------------------

// Bit position of field f (0 = m, 1 = e0, 2 = e1, 3 = sign) of the value in A register j
// (0..3), half h (0 = low, 1 = high), inside the thread's 32-bit word. Chosen (by exhaustive
// search) so that the four registers cost 9 ALU operations: three rotate+mask, one
// rotate+mask+merge.
constexpr uint8_t kFieldPos[4][2][4] = {
    {{30, 7, 8, 15}, {14, 23, 24, 31}},   // a0: m rotated left 8, the rest in place
    {{0, 1, 2, 9}, {16, 17, 18, 25}},     // a1: rotate left 6
    {{26, 27, 28, 3}, {10, 11, 12, 19}},  // a2: rotate left 12
    {{4, 5, 6, 13}, {20, 21, 22, 29}},    // a3: rotate left 2
};

DSV4_MOE_HD uint32_t rotl32(uint32_t x, int n) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(x, x, n);
#else
  return n == 0 ? x : (x << n) | (x >> (32 - n));
#endif
}

// The four BF16x2 patterns (value = e2m1 * 2^-126) of one code word.
DSV4_MOE_HD void fp4_word_to_bf16x2(uint32_t q, uint32_t (&v)[4]) {
  constexpr uint32_t kMask = 0x81C081C0u;  // sign 15, e1 e0 m at 8..6, both halves
  v[0] = (rotl32(q, 8) & 0x00400040u) | (q & 0x81808180u);
  v[1] = rotl32(q, 6) & kMask;
  v[2] = rotl32(q, 12) & kMask;
  v[3] = rotl32(q, 2) & kMask;
}

// BF16x2 scale (same value in both halves) from a packed scale byte.
template <ExpertFormat F>
DSV4_MOE_HD uint32_t fp4_scale_bf16x2(uint32_t byte, uint32_t bias) {
  const uint32_t both = byte | (byte << 16);
  return F == ExpertFormat::kMxfp4 ? both * 128u + bias : both * 16u + bias;
}

// Two BF16 scales of one row from a scale word (four record bytes b0..b3): row 0 of the pair
// (odd = false) takes bytes 0 and 2, row 1 takes bytes 1 and 3; the low half gets the first
// (group 2j), the high half the second (group 2j + 1). Each half equals the broadcast value of
// fp4_scale_bf16x2 for its byte, so a kernel multiplies by one half (a BF16x2 operand picking
// .H0_H0 / .H1_H1) and expands two scales with one multiply-add.
template <ExpertFormat F>
DSV4_MOE_HD uint32_t fp4_scale_row_pair(uint32_t word, bool odd, uint32_t bias) {
  const uint32_t two = (odd ? word >> 8 : word) & 0x00FF00FFu;
  return F == ExpertFormat::kMxfp4 ? two * 128u + bias : two * 16u + bias;
}

// Where element (row rr, column kc) of a 64x64 tile lives: thread, k16 step, A register,
// half; and its scale record byte.
struct TileSlot {
  int thread, kk, reg, half;
  int scale_byte;  // offset from the start of the scale area
};
DSV4_MOE_HD TileSlot tile_slot(ExpertFormat f, int rr, int kc) {
  const int w = rr / 16, within = rr % 16, rlo = within % 8, rhi = within / 8;
  const int kk = kc / 16, kin = kc % 16, clo = kin % 8, second = kin / 8;
  TileSlot s;
  s.thread = 32 * w + 4 * rlo + clo / 2;
  s.kk = kk;
  s.reg = 2 * second + rhi;
  s.half = clo % 2;
  const int rp = 8 * w + rlo;
  s.scale_byte = f == ExpertFormat::kMxfp4 ? 4 * rp + 2 * (kc / 32) + rhi : 8 * rp + 2 * kk + rhi;
  return s;
}

// Packed row -> (projection 0 = w1 / 1 = w3, source row) of the interleaved gate/up matrix.
DSV4_MOE_HD void gate_up_source(int packed_row, int& proj, int& row) {
  proj = (packed_row % 16) / 8;
  row = (packed_row / 16) * 8 + packed_row % 8;
}

}  // namespace dsv4::cuda::moe
