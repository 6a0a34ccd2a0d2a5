// Error bounds of GPU kernels against the CPU reference ops, derived from the arithmetic of both
// (what verify mode judges each op by). Every bound is per element and holds for any correct
// kernel that follows the model stated here; a fault shows as an element outside its bound.
//
// Tensor-core sums (TcSum). The products of one output are summed by hardware accumulate steps:
// one step takes a group of products (an MMA instruction's K: 32 for FP8 wgmma, 16 for BF16, or
// a part of it: how the hardware groups inside an instruction is not documented, so every group
// of slice, slice/2, ..., min_group products is modelled and the largest bound taken) plus the
// incoming accumulator, aligns them to the largest operand and keeps `frac_bits` fraction bits
// below its leading bit, truncating the rest (FP8 wgmma on Hopper: 13, the ~14 significant bits
// of its accumulator; BF16 MMA with fp32 accumulation: 23). So in one step with largest operand
// magnitude M and U = 2^(floor(log2 M) - frac_bits), a product p loses exactly |p| mod U (zero
// for the products within 2^(frac_bits - 7) of M: e4m3 x e4m3 products have 8 significant bits),
// the incoming accumulator less than min(|c|, U), and the normalised result less than one unit
// of its own binade, 2^(floor(log2 |result|) - frac_bits); the losses are added in magnitude
// (their signs are not known). A larger U only loses more, so U is taken at the upper bound of
// |c|: the CPU's exact partial of the chain plus the bound so far. Instructions chain
// `chain_slices` times in the tensor-core accumulator before the partial is promoted into an
// fp32 accumulator (FP8 blockwise GEMM: 4 x 32 = the 128 block whose scales are applied at the
// promotion; the decode stream kernel: every 32-wide slice; BF16 kernels: never, the whole K is
// one chain). The block scales are powers of two, constant over a 128 block, so alignment and
// truncation in code space are the same as in value space: the bound is computed on dequantised
// values. Promotions and split-K reductions are fp32 additions (round to nearest, 2^-24
// relative), bounded by 2^-24 * sum|products| each. The CPU's own error (cpu::linear: exact
// products, each block summed in double, rounded to fp32 and accumulated in fp32) is added:
// 2^-24 * sum|p| per block rounding and per fp32 addition. Cancellation (small |result|, large
// sum|p|) is so judged by what the hardware can lose, not by a fixed fraction of the result.
// On random data the FP8 bound averages 1-7 BF16 ulps of the output (K = 128..2048) beyond the
// output roundings; an emulation of the model (error_bound_test) lands within 0.7-0.93 of it,
// with 99.1-99.7 % of its outputs within one ulp of the exact sums (the H200's FP8 GEMMs: 99.2-
// 99.5 % on the make-tiny presets, 98.87 % on the geometry of engine_verify_geometry_test).
//
// Output rounding: a BF16 (fp32) output of a kernel is within half a BF16 (fp32) ulp of the value
// it rounds, and so is the CPU's; check_bounds adds half an ulp of each side (of the rounded
// values' binades, which is never smaller than that of the unrounded ones).
//
// Intervals (Iv). Ops with intermediate roundings (BF16, e4m3, e2m1) are bounded by evaluating
// the reference with intervals: each fp32 operation widened by its rounding bound on either
// side, each rounding applied to both ends (rounding is monotone), so a flip of an intermediate
// rounding on the GPU stays inside the interval and nothing else does.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "ops/cpu/attention.h"
#include "ops/cpu/linear.h"

namespace dsv4::cpu {

// One ulp of the binade of |v| in BF16 (8 significant bits) or fp32 (24); v == 0: the ulp of the
// smallest normal (subnormal spacing).
double bf16_ulp(double v);
double f32_ulp(double v);
// The largest power of two <= |v| (0 for v == 0).
double pow2_floor(double v);

struct TcSum {
  int frac_bits;     // fraction bits an accumulate step keeps
  int slice;         // products per MMA instruction (its K)
  int chain_slices;  // instructions per tensor-core chain before an fp32 promotion; 0: whole K
  int fp32_adds;     // further fp32 additions per output outside the chains (split-K reductions)
  int min_group;     // the hardware may split an instruction into accumulate steps of
                     // slice, slice/2, ..., min_group products: the bound is the largest
};
// CUTLASS blockwise FP8 GEMM (prefill, m > 64): four k32 wgmma per 128 block, then promotion.
inline constexpr TcSum kFp8WgmmaBlock{13, 32, 4, 8, 8};
// Weight-streaming FP8 GEMM (decode, m <= 64): each k32 slice promoted; K split over <= 16 CTAs
// (a cluster's partials summed in fp32, gemm_cfg::kStreamMaxSplits).
inline constexpr TcSum kFp8WgmmaSlice{13, 32, 1, 16, 8};
// BF16 x BF16 (or BF16-decoded FP8/FP4) products, fp32 accumulation over the whole K (W8A16,
// wo_a, the head, the MoE experts, cuBLAS BF16 GEMMs); split-K reductions allowed.
inline constexpr TcSum kBf16Mma{23, 16, 0, 16, 8};

// Per element bound on |y_gpu - y_cpu| of y = x W^T before output rounding, for a kernel summing
// as `tc` and cpu::linear (x: the same rows cpu::linear takes; quantised the same way). `exact`
// (optional, [m, out]): the exact sums, which the bound also covers the distance to (for
// callers that round or transform the unrounded sums themselves).
void linear_error_bound(const Linear& w, const float* x, int m, const TcSum& tc, float* bound,
                        double* exact = nullptr);

// Closed form of the same model for an n-product dot product summed by BF16 MMA / fp32 with no
// per-step detail (small reductions inside attention-like ops): each step of 16 products loses
// < 17 U + one unit of its result <= 18 * 2^-23 * sum|p| (M, the accumulator and the result are
// <= sum|p|), plus an fp32 rounding on either side.
inline double dot_error_bound(int n, double sum_abs) {
  return (18.0 * ((n + 15) / 16) + 2.0) * 0x1p-23 * sum_abs;
}

// Ops whose inputs are identical on both sides and whose fp32 arithmetic differs only in order,
// FMA contraction and rounding: `ops` roundings of 2^-24 each side relative to `magnitude`.
inline double fp32_ops_bound(int ops, double magnitude) {
  return 2.0 * ops * 0x1p-24 * magnitude;
}

// ---- intervals -----------------------------------------------------------------------------
struct Iv {
  double lo = 0, hi = 0;
  static Iv of(double v, double r = 0) { return {v - r, v + r}; }
  double mid() const { return 0.5 * (lo + hi); }
  double width() const { return hi - lo; }
  bool contains(double v) const { return v >= lo && v <= hi; }
};
inline double maxabs(const Iv& a) {
  return std::max(std::fabs(a.lo), std::fabs(a.hi));
}
inline Iv operator+(Iv a, Iv b) {
  return {a.lo + b.lo, a.hi + b.hi};
}
inline Iv operator-(Iv a, Iv b) {
  return {a.lo - b.hi, a.hi - b.lo};
}
Iv operator*(Iv a, Iv b);
inline Iv operator*(Iv a, double s) {
  return s >= 0 ? Iv{a.lo * s, a.hi * s} : Iv{a.hi * s, a.lo * s};
}
// Widened by an absolute error r on either side.
inline Iv widen(Iv a, double r) {
  return {a.lo - r, a.hi + r};
}
// Widened by `ops` fp32 roundings (2^-24 relative each) on either side.
Iv widen_f32(Iv a, int ops);
Iv round_ends_bf16(Iv a);
Iv relu_ends(Iv a);
// Monotone scalar quantisers: x -> q(x / s) * s, e4m3 (saturating at 448) or e2m1 (at 6).
double fake_e4m3(double x, double s);
double fake_e2m1(double x, double s);
// Per block of `block` elements, the fake quantisation (cpu::fake_quant_fp8 / _fp4) of any values
// inside the intervals: the block scale is taken at the interval ends of the block's amax.
void fake_quant_interval(const Iv* x, int n, int block, bool fp4, Iv* out);

// cpu::sparse_attention of one token (all heads) on intervals, robust to how the GPU blocks and
// splits the keys: every probability is exp(s_j - m) of a score within the BF16 MMA dot bound,
// with the exp / max-subtraction / rescaling errors, rounded to BF16 against some running max on
// either side (a relative 2^-9 each way, whatever the max; the denominator may take it or not);
// P.V and the denominator summed in fp32 (one rescale per block of 64 keys); the output rounded
// to BF16 on both ends. out: [n_heads, head_dim].
void attention_interval(const SparseAttnParams& p, const float* q, const float* const* keys,
                        int num_keys, Iv* out);

// ---- judging -------------------------------------------------------------------------------
enum class Rounding {
  kNone,  // the bound already includes every rounding (interval ends, exact copies)
  kBf16,  // both values are BF16 roundings of what the bound covers
  kF32,   // both are fp32 roundings
};

struct BoundCheck {
  size_t n = 0;
  size_t beyond = 0;            // elements outside their bound
  size_t first_bad = SIZE_MAX;  // first of them
  size_t worst = 0;             // element of the largest |d| / tolerance
  double worst_ratio = 0;       // its |d| / tolerance (<= 1 passes)
  double worst_tol = 0;
  double rel_l2 = 0;          // reported, not judged
  bool nan_mismatch = false;  // a NaN on one side only (first_bad points at it)
  bool ok() const { return beyond == 0 && !nan_mismatch; }
};

// |got[i] - want[i]| <= bound[i] + the output roundings of `r`, element by element.
BoundCheck check_bounds(const float* got, const float* want, const float* bound, size_t n,
                        Rounding r);
// The tolerance check_bounds allows element i.
double element_tolerance(float got, float want, double bound, Rounding r);

}  // namespace dsv4::cpu
