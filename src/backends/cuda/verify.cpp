#include "backends/cuda/verify.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <set>
#include <sstream>

#include "core/formats.h"
#include "core/parallel.h"
#include "ops/common/score_func.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/cache_codec.h"
#include "ops/cpu/compressor.h"
#include "ops/cpu/hadamard.h"
#include "ops/cpu/indexer.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/mhc.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/norm.h"
#include "ops/cpu/quant.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/gemm/fp8_gemm_heuristic.h"

namespace dsv4 {
namespace {

using bf16_dev = __nv_bfloat16;

// One BF16 ulp of `ref` (2^(e-8) for |ref| in [2^(e-1), 2^e)).
double bf16_ulp(double ref) {
  int e;
  std::frexp(ref == 0 ? 1e-30 : ref, &e);
  return std::ldexp(1.0, e - 8);
}

bool within_bf16_ulp(float a, float b) {
  const double m = std::max(std::fabs(double(a)), std::fabs(double(b)));
  return std::fabs(double(a) - b) <= bf16_ulp(m) * 1.0000001;
}

// One quantisation step of a decoded value v with block scale s: e4m3 (3 mantissa bits,
// subnormal step 2^-9) or e2m1 (grid 0, .5, 1, 1.5, 2, 3, 4, 6).
double quant_step(double v, double s, bool fp4) {
  const double x = std::fabs(v) / s;
  if (fp4) return (x < 2 ? 0.5 : x < 4 ? 1.0 : 2.0) * s;
  if (x < std::ldexp(1.0, -6)) return std::ldexp(1.0, -9) * s;
  int e;
  std::frexp(x, &e);  // x in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 1 - 3) * s;
}

std::string index_str(size_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    const int64_t n = std::max<int64_t>(shape[d], 1);
    idx[d] = int64_t(flat % n);
    flat /= n;
  }
  std::ostringstream os;
  os << "[";
  for (size_t d = 0; d < idx.size(); ++d) os << (d ? ", " : "") << idx[d];
  os << "]";
  return os.str();
}

const char* store_name(int kind) {
  return kind == 0 ? "window KV" : kind == 1 ? "compressed KV" : "indexer keys";
}

// ---- bounds ----------------------------------------------------------------------------------

using cpu::Iv;

// The bound of each element from its interval: the distance from the CPU's value to either end.
std::vector<float> interval_bound(const std::vector<Iv>& iv, const std::vector<float>& want) {
  std::vector<float> b(want.size());
  for (size_t i = 0; i < want.size(); ++i)
    b[i] = static_cast<float>(std::max(iv[i].hi - want[i], want[i] - iv[i].lo) * (1 + 0x1p-20));
  return b;
}

// rope_apply on intervals (pairs (2i, 2i+1) of x [rope_dim]): two products and a sum per output
// in fp32 on either side, and the GPU's cos/sin table within 2 fp32 ulps of the CPU's.
void rope_interval(Iv* x, int rope_dim, const float* c, const float* s, bool inverse) {
  for (int i = 0; i < rope_dim / 2; ++i) {
    const Iv a = x[2 * i], b = x[2 * i + 1];
    const double sn = inverse ? -s[i] : s[i], cs = c[i];
    const double mag = maxabs(a) * std::fabs(cs) + maxabs(b) * std::fabs(sn);
    const double err = cpu::fp32_ops_bound(3, mag) + (maxabs(a) + maxabs(b)) * 0x1p-22;
    x[2 * i] = cpu::round_ends_bf16(cpu::widen(a * cs - b * sn, err));
    x[2 * i + 1] = cpu::round_ends_bf16(cpu::widen(a * sn + b * cs, err));
  }
}

// y = bf16(w * (x * rs)), rs = 1 / sqrt(mean(x^2) + eps) (cpu::rms_norm) on intervals: the sum
// of squares in fp32 or double on the GPU (n roundings at most), rs from correctly rounded
// fp32 operations, two products per element.
void rms_norm_interval(const Iv* x, int n, const float* w, float eps, Iv* y) {
  double lo = 0, hi = 0;
  for (int i = 0; i < n; ++i) {
    const double a = x[i].lo * x[i].lo, b = x[i].hi * x[i].hi;
    lo += x[i].lo <= 0 && x[i].hi >= 0 ? 0.0 : std::min(a, b);
    hi += std::max(a, b);
  }
  const Iv ms = cpu::widen_f32({lo / n, hi / n}, n + 2);
  const Iv rs = cpu::widen_f32(
      {1.0 / std::sqrt(ms.hi + eps), 1.0 / std::sqrt(std::max(ms.lo, 0.0) + eps)}, 4);
  for (int i = 0; i < n; ++i)
    y[i] = cpu::round_ends_bf16(cpu::widen_f32(cpu::widen_f32(x[i] * rs, 1) * double(w[i]), 1));
}

// Bound of one mHC mix m = (X . f) * rs: the GPU splits fp32 operands into three BF16 parts
// (exact) and sums the 3n products by BF16 MMA; rs within (n / 2 + 8) fp32 roundings. The split-K
// decode path (ops/cuda/mhc/mhc_split.h) sums the same products in chains of 6 MMA k-steps per 32
// dims of one stream in a CTA's range (at most 3 dim / 16 steps, a quarter of the one chain's
// 3n / 16), adds a CTA's 4 chains in fp32 and the CTAs in fp64: the chains' bounds add up to at
// most (18 * 3n / 64 + 2) 2^-23 sum|x f|, plus 3 fp32 additions, inside this one-chain bound.
double mix_bound(const cpu::HcParams& p, const float* X, int row, double m, double rs) {
  const int n = p.hc * p.dim;
  const float* f = p.fn + size_t(row) * n;
  double sabs = 0;
  for (int i = 0; i < n; ++i) sabs += std::fabs(double(X[i]) * f[i]);
  return cpu::dot_error_bound(3 * n, sabs * (1 + 0x1p-7)) * rs +
         std::fabs(m) * (n / 2 + 8) * 0x1p-24;
}

double sigmoid_d(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// cpu::sinkhorn in double (for its Jacobian).
void sinkhorn_d(double* c, int hc, int iters, double eps) {
  for (int j = 0; j < hc; ++j) {
    double* row = c + j * hc;
    double mx = row[0], sum = 0;
    for (int k = 1; k < hc; ++k) mx = std::max(mx, row[k]);
    for (int k = 0; k < hc; ++k) sum += (row[k] = std::exp(row[k] - mx));
    for (int k = 0; k < hc; ++k) row[k] = row[k] / sum + eps;
  }
  auto norm = [&](bool cols) {
    for (int a = 0; a < hc; ++a) {
      double s = 0;
      for (int b = 0; b < hc; ++b) s += cols ? c[b * hc + a] : c[a * hc + b];
      for (int b = 0; b < hc; ++b) (cols ? c[b * hc + a] : c[a * hc + b]) /= (s + eps);
    }
  };
  norm(true);
  for (int it = 1; it < iters; ++it) {
    norm(false);
    norm(true);
  }
}

// y = x W^T's bound from input intervals: sum_k |w_kn| * dx_k added to `bound` [m, out] for
// inputs known only to within dx [m, in] (most dx are 0).
void add_input_spread(const cpu::Linear& L, const std::vector<double>& dx, int m,
                      std::vector<float>& bound) {
  // (8-row tile, 512-column chunk) work items over the host's cores (a GEMM's worth of work: the
  // MoE's w2 over every pair): a weight row's chunk is read once for the tile's rows, and each
  // element still adds its terms in k order.
  constexpr int kRows = 8, kCols = 512;
  const int tiles = (m + kRows - 1) / kRows, chunks = (L.out + kCols - 1) / kCols;
  parallel_for(int64_t(tiles) * chunks, int64_t(m) * L.in * L.out, [&](int64_t item) {
    const int r0 = int(item / chunks) * kRows, n0 = int(item % chunks) * kCols;
    const int r1 = std::min(m, r0 + kRows), n1 = std::min(L.out, n0 + kCols);
    for (int k = 0; k < L.in; ++k) {
      const float* wk = L.wt.data() + size_t(k) * L.out;
      for (int r = r0; r < r1; ++r) {
        const double d = dx[size_t(r) * L.in + k];
        if (d == 0) continue;
        float* b = bound.data() + size_t(r) * L.out;
        for (int n = n0; n < n1; ++n)
          b[n] += static_cast<float>(d * std::fabs(wk[n]) * (1 + 0x1p-20));
      }
    }
  });
}

// Router scores of one row's logits (cpu::moe_route) and a bound of each from the logits' bound.
void scores_with_bound(ScoreFunc f, const std::vector<float>& logits, const std::vector<double>& dl,
                       std::vector<double>& s, std::vector<double>& ds) {
  const size_t E = logits.size();
  s.assign(E, 0);
  ds.assign(E, 0);
  double dmax = 0, mx = -INFINITY, sum = 0;
  for (size_t e = 0; e < E; ++e) dmax = std::max(dmax, dl[e]), mx = std::max(mx, double(logits[e]));
  for (size_t e = 0; e < E; ++e) {
    const double l = logits[e];
    switch (f) {
      case ScoreFunc::kSqrtSoftplus: {
        const double sp = l > 20 ? l : std::log1p(std::exp(l));
        s[e] = std::sqrt(sp);
        const double dsp = sigmoid_d(l) * dl[e] + 8 * 0x1p-24 * sp;
        ds[e] = (s[e] > 0 ? dsp / (2 * s[e]) : std::sqrt(dsp)) + 4 * 0x1p-24 * s[e];
        break;
      }
      case ScoreFunc::kSigmoid:
        s[e] = sigmoid_d(l);
        ds[e] = 0.25 * dl[e] + 8 * 0x1p-24 * s[e];
        break;
      case ScoreFunc::kSoftmax:
        sum += (s[e] = std::exp(l - mx));
        break;
    }
  }
  if (f == ScoreFunc::kSoftmax)
    for (size_t e = 0; e < E; ++e) {
      s[e] /= sum;
      ds[e] = s[e] * (std::expm1(2 * dmax) + (E + 8) * 2 * 0x1p-24);
    }
}

// cpu::indexer_scores on intervals: per head the dot product (BF16 MMA model) rounded to BF16,
// ReLU, times the head weight rounded to BF16, the fp32 sum over heads rounded to BF16.
void indexer_interval(const float* q, const float* w, int n_heads, int dim, const float* keys,
                      int num_keys, Iv* out) {
  for (int t = 0; t < num_keys; ++t) {
    const float* k = keys + size_t(t) * dim;
    Iv total{0, 0};
    double mag = 0;
    for (int h = 0; h < n_heads; ++h) {
      const float* qh = q + size_t(h) * dim;
      double d = 0, sabs = 0;
      for (int i = 0; i < dim; ++i) {
        d += double(qh[i]) * k[i];
        sabs += std::fabs(double(qh[i]) * k[i]);
      }
      const Iv s = cpu::relu_ends(cpu::round_ends_bf16(Iv::of(d, cpu::dot_error_bound(dim, sabs))));
      const Iv p = cpu::round_ends_bf16(cpu::widen_f32(s * double(w[h]), 1));
      total = total + p;
      mag += maxabs(p);
    }
    out[t] = cpu::round_ends_bf16(cpu::widen(total, cpu::fp32_ops_bound(n_heads, mag)));
  }
}

}  // namespace

CudaVerifier::CudaVerifier(const ModelConfig& c, const cpu::ModelWeights& w,
                           const DeviceCache& cache, cudaStream_t stream, VerifyTolerances tol)
    : c_(c), w_(w), cache_(cache), stream_(stream), tol_(tol) {
  DSV4_CHECK(int(w.blocks.size()) == c.num_blocks(), "verifier: CPU weights do not match");
}

// ---- device reads --------------------------------------------------------------------------

template <class T>
std::vector<T> CudaVerifier::download(const void* p, size_t n) const {
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<T> v(n);
  if (n) DSV4_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

std::vector<float> CudaVerifier::bf16(const bf16_dev* p, size_t n) const {
  const std::vector<uint16_t> raw = download<uint16_t>(p, n);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = bf16_to_float(raw[i]);
  return v;
}

std::vector<float> CudaVerifier::f32(const float* p, size_t n) const {
  return download<float>(p, n);
}

std::vector<uint8_t> CudaVerifier::bytes(const void* p, size_t n) const {
  return download<uint8_t>(p, n);
}

// Rows [m, width] of a strided device matrix, contiguous on the host.
static std::vector<float> rows_of(const CudaVerifier& v, const void* p, int64_t ld, int m,
                                  int width, bool f32) {
  std::vector<float> out(size_t(m) * width);
  if (m == 0) return out;
  std::vector<float> all =
      f32 ? v.f32(static_cast<const float*>(p), size_t(m - 1) * ld + width)
          : v.bf16(static_cast<const bf16_dev*>(p), size_t(m - 1) * ld + width);
  for (int r = 0; r < m; ++r)
    std::copy_n(all.begin() + size_t(r) * ld, width, out.begin() + size_t(r) * width);
  return out;
}

// A whole store of one block copied to the host; entries are read at their device offsets.
struct StoreCopy {
  const uint8_t* base = nullptr;
  std::vector<uint8_t> host;
  const uint8_t* at(const uint8_t* dev) const {
    const int64_t off = dev - base;
    DSV4_CHECK(off >= 0 && off < int64_t(host.size()), "verify: entry outside its store");
    return host.data() + off;
  }
};

static StoreCopy copy_store(const CudaVerifier& v, const DeviceCache& c, int block, int kind) {
  const auto [base, n] = c.store_range(block, kind);
  return {base, v.bytes(base, size_t(n))};
}

// ---- reporting -------------------------------------------------------------------------------

std::string CudaVerifier::block_name(int block) const {
  if (block < 0) return "model";
  const int r = c_.ratio(block);
  const char* kind = r == 4 ? "CSA" : r == 128 ? "HCA" : "SWA";
  if (block >= c_.n_layers) return cat("MTP block ", block - c_.n_layers, " (", kind, ")");
  return cat("block ", block, " (", kind, ")");
}

void CudaVerifier::fail(const std::string& op, int block, const std::string& detail) const {
  throw VerifyError(
      cat("verify: first divergence at ", block_name(block), ", op '", op, "': ", detail));
}

void CudaVerifier::judge(const std::string& op, int block, const std::vector<float>& a,
                         const std::vector<float>& b, const std::vector<float>& bound,
                         cpu::Rounding r, const std::vector<int64_t>& shape) {
  DSV4_CHECK(a.size() == b.size() && b.size() == bound.size(), "verify ", op, ": sizes differ (",
             a.size(), " vs ", b.size(), " vs ", bound.size(), ")");
  const cpu::BoundCheck c = cpu::check_bounds(a.data(), b.data(), bound.data(), a.size(), r);
  OpStats& s = ops_[op];
  ++s.count;
  ++checked_;
  s.worst_rel_l2 = std::max(s.worst_rel_l2, c.rel_l2);
  s.worst_ratio = std::max(s.worst_ratio, c.worst_ratio);
  if (c.ok()) return;
  const size_t i = c.first_bad;
  if (c.nan_mismatch && std::isnan(a[i]) != std::isnan(b[i]))
    fail(op, block, cat("NaN at ", index_str(i, shape), ": cuda ", a[i], ", cpu ", b[i]));
  const double tol = cpu::element_tolerance(a[i], b[i], bound[i], r);
  fail(op, block,
       cat(c.beyond, " of ", a.size(), " elements outside their derived bound; first at ",
           index_str(i, shape), ": cuda ", a[i], ", cpu ", b[i], ", |d| ",
           std::fabs(double(a[i]) - b[i]), " > tolerance ", tol, " (arithmetic bound ", bound[i],
           r == cpu::Rounding::kNone ? "" : " + output roundings", "); worst |d| / tolerance ",
           c.worst_ratio, " at ", index_str(c.worst, shape), ": cuda ", a[c.worst], ", cpu ",
           b[c.worst], "; relative L2 ", c.rel_l2));
}

void CudaVerifier::compare_exact(const std::string& op, int block, const std::vector<float>& a,
                                 const std::vector<float>& b, const std::vector<int64_t>& shape) {
  judge(op, block, a, b, std::vector<float>(a.size(), 0.0f), cpu::Rounding::kNone, shape);
}

void CudaVerifier::compare_rel_l2(const std::string& op, int block, const std::vector<float>& a,
                                  const std::vector<float>& b, const std::vector<int64_t>& shape,
                                  double limit) {
  DSV4_CHECK(a.size() == b.size(), "verify ", op, ": sizes differ (", a.size(), " vs ", b.size(),
             ")");
  double num = 0, den = 0, max_abs = 0;
  size_t worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], y = b[i];
    if (std::isnan(x) != std::isnan(y))
      fail(op, block, cat("NaN at ", index_str(i, shape), ": cuda ", x, ", cpu ", y));
    if (std::isnan(x) || (std::isinf(x) && std::isinf(y) && (x > 0) == (y > 0))) continue;
    const double d = std::fabs(x - y);
    num += d * d;
    den += y * y;
    if (d > max_abs || (std::isinf(d) && !std::isinf(max_abs))) max_abs = d, worst = i;
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  OpStats& s = ops_[op];
  ++s.count;
  ++checked_;
  s.worst_rel_l2 = std::max(s.worst_rel_l2, rel);
  if (rel <= limit) return;
  fail(op, block,
       cat("relative L2 ", rel, " (limit ", limit, "); largest |d| ", max_abs, " at ",
           index_str(worst, shape), ": cuda ", a[worst], ", cpu ", b[worst], " (", a.size(),
           " elements)"));
}

void CudaVerifier::compare_entry(const std::string& op, int block, int kind, const uint8_t* cd,
                                 const uint8_t* cs, const uint8_t* pd, const uint8_t* ps,
                                 const std::string& where) {
  const bool fp4 = kind == 2;
  const KvEntryLayout& kl = cache_.kv_layout();
  const IndexKeyLayout& il = cache_.index_layout();
  const int data_bytes = fp4 ? il.data_bytes() : kl.data_bytes();
  const int scale_bytes = fp4 ? il.scale_bytes() : kl.scale_bytes();
  const int width = fp4 ? il.dim : kl.nope_dim + kl.rope_dim;
  const int quant_dims = fp4 ? il.dim : kl.nope_dim;
  const int block_elems = fp4 ? IndexKeyLayout::kQuantBlock : KvEntryLayout::kQuantBlock;
  CacheStoreStats& st = stores_[kind];
  int64_t same = 0;
  for (int i = 0; i < data_bytes; ++i) same += cd[i] == pd[i];
  for (int i = 0; i < scale_bytes; ++i) same += cs[i] == ps[i];
  st.bytes += data_bytes + scale_bytes;
  st.identical += same;
  std::vector<float> a(width), b(width);
  if (fp4) {
    cpu::decode_index_key(il, cd, cs, a.data());
    cpu::decode_index_key(il, pd, ps, b.data());
  } else {
    cpu::decode_kv_entry(kl, cd, cs, a.data());
    cpu::decode_kv_entry(kl, pd, ps, b.data());
  }
  for (int i = 0; i < width; ++i) {
    ++st.elements;
    if (a[i] == b[i]) continue;
    bool ok;
    if (i >= quant_dims) {
      ok = within_bf16_ulp(a[i], b[i]);
    } else {
      const double sa = e8m0_to_float(cs[i / block_elems]);
      const double sb = e8m0_to_float(ps[i / block_elems]);
      const double step = std::max(quant_step(a[i], sa, fp4), quant_step(b[i], sb, fp4));
      ok = std::fabs(double(a[i]) - b[i]) <= step * 1.0000001;
    }
    if (ok) {
      ++st.elements_one_step;
      continue;
    }
    ++st.elements_beyond;
    fail(op, block,
         cat(store_name(kind), " entry ", where, ", element ", i, ": cuda ", a[i], ", cpu ", b[i],
             i < quant_dims ? cat(" (scales cuda 2^", int(cs[i / block_elems]) - 127, ", cpu 2^",
                                  int(ps[i / block_elems]) - 127, ")")
                            : std::string(" (BF16 RoPE dim)"),
             ": more than one ", fp4 ? "e2m1" : (i < quant_dims ? "e4m3" : "BF16"), " step apart"));
  }
}

std::string CudaVerifier::summary() const {
  std::ostringstream os;
  os << "verify: " << checked_ << " op checks, no divergence";
  if (first_block_ > 0 || last_block_ < c_.num_blocks() - 1)
    os << " (the ops of blocks " << first_block_ << ".." << last_block_
       << " and the embedding and head; the other blocks ran unchecked)";
  for (const auto& [name, s] : ops_) {
    os << "\n  " << name << ": " << s.count << " checks, worst relative L2 " << s.worst_rel_l2
       << ", worst |d| / bound " << s.worst_ratio;
  }
  for (int k = 0; k < 3; ++k) {
    const CacheStoreStats& s = stores_[k];
    if (!s.bytes) continue;
    os << "\n  cache " << store_name(k) << ": " << s.bytes << " bytes written, "
       << 100.0 * s.identical_fraction() << "% identical; " << s.elements_one_step << " of "
       << s.elements << " elements one step apart, " << s.elements_beyond << " beyond";
  }
  os << "\n" << time_report();
  return os.str();
}

std::string CudaVerifier::time_report() const {
  static constexpr const char* kKindNames[] = {
      "step begin",  "step end", "embed",      "hc_pre",  "hc_post",   "linear",   "rms_norm",
      "q_norm_rope", "kv",       "compressor", "indexer", "attention", "wo_a",     "window",
      "swiglu",      "moe",      "hc_head",    "logits",  "mtp",       "attn sub", "ffn sub"};
  static_assert(std::size(kKindNames) == size_t(OpKind::kFfnSublayer) + 1);
  std::ostringstream os;
  os.precision(3);
  os << "verify host seconds by op kind:";
  for (size_t k = 0; k < std::size(kKindNames); ++k)
    if (kind_seconds_[k] >= 0.0005) os << " " << kKindNames[k] << " " << kind_seconds_[k];
  os << "; linears:";
  for (const auto& [name, sec] : linear_seconds_) os << " " << name << " " << sec;
  return os.str();
}

// ---- steps ---------------------------------------------------------------------------------

void CudaVerifier::begin_step(const OpEvent& e) {
  chunks_ = e.chunks;
  tokens_ = e.tokens;
  row0_.clear();
  int row = 0;
  for (const ChunkRef& c : *chunks_) {
    row0_.push_back(row);
    row += c.n;
  }
  last_o_.clear();
  last_o_block_ = -1;
}

void CudaVerifier::end_step(const OpEvent&) {
  for (int k = 0; k < 3; ++k) {
    const CacheStoreStats& s = stores_[k];
    if (s.bytes < tol_.cache_min_bytes) continue;
    if (s.identical_fraction() < tol_.cache_identical)
      throw VerifyError(cat("verify: cache store '", store_name(k),
                            "': ", 100.0 * s.identical_fraction(), "% of ", s.bytes,
                            " bytes written identical to the CPU's (limit ",
                            100.0 * tol_.cache_identical, "%)"));
  }
  chunks_ = nullptr;
}

// ---- the op events ---------------------------------------------------------------------------

void CudaVerifier::hc_pre(const OpEvent& e) {
  const TensorRef& in = e.t[0];
  hc_pre(e.block, e.id != 0, bf16(in.as<bf16_dev>(), size_t(in.rows * in.cols)),
         e.t[1].as<bf16_dev>(), e.t[2].as<float>(), e.t[3].as<float>());
}

void CudaVerifier::set_blocks(int first, int last) {
  const int n = c_.num_blocks();
  if (last < 0) last = n - 1;
  DSV4_CHECK(first >= 0 && first <= last && last < n, "verify: blocks ", first, "..", last,
             " are not within the model's blocks 0..", n - 1, " (", c_.n_layers, " layers + ",
             c_.n_mtp_layers, " MTP)");
  first_block_ = first;
  last_block_ = last;
}

void CudaVerifier::before(const OpEvent& e) {
  if (!checks(e.block)) return;
  const TensorRef& t = e.t[0];
  if (e.kind == OpKind::kQNormRope)
    q_in_ = rows_of(*this, t.data, t.stride(), int(t.rows), int(t.cols), false);
  if (e.kind == OpKind::kCompressor) before_compressor(e.block, e.id != 0);  // states it updates
}

void CudaVerifier::after(const OpEvent& e) {
  using Check = void (CudaVerifier::*)(const OpEvent&);
  // Indexed by OpKind; null: nothing to check (sub-layers: their ops are checked one by one).
  // clang-format off
  static constexpr Check kChecks[] = {
      &CudaVerifier::begin_step, &CudaVerifier::end_step,      &CudaVerifier::embed,
      &CudaVerifier::hc_pre,     &CudaVerifier::hc_post,       &CudaVerifier::linear,
      &CudaVerifier::rms_norm,   &CudaVerifier::q_norm_rope,   &CudaVerifier::kv_entries,
      &CudaVerifier::compressor, &CudaVerifier::indexer,       &CudaVerifier::attention,
      &CudaVerifier::wo_a,       &CudaVerifier::window_insert, &CudaVerifier::swiglu,
      &CudaVerifier::moe,        &CudaVerifier::hc_head,       &CudaVerifier::logits,
      &CudaVerifier::mtp_combine, nullptr,                     nullptr};
  // clang-format on
  static_assert(std::size(kChecks) == size_t(OpKind::kFfnSublayer) + 1);
  const auto t0 = std::chrono::steady_clock::now();
  // hc_post carries the next block's fused hc_pre: it gates its two checks itself.
  const bool wanted =
      checks(e.block) || (e.kind == OpKind::kHcPost && e.next_block >= 0 && checks(e.next_block));
  if (const Check c = kChecks[size_t(e.kind)]; c && wanted) (this->*c)(e);
  const auto now = std::chrono::steady_clock::now();
  const double spent = std::chrono::duration<double>(now - t0).count();
  kind_seconds_[size_t(e.kind)] += spent;
  if (e.kind == OpKind::kLinear) linear_seconds_[op_name(LinearId(e.id))] += spent;
  if (std::chrono::duration<double>(now - last_progress_).count() >= kProgressSeconds) {
    last_progress_ = now;
    std::fprintf(stderr, "verify: %lld op checks, at %s, %.0f s\n  %s\n",
                 static_cast<long long>(checked_), block_name(e.block).c_str(),
                 std::chrono::duration<double>(now - start_).count(), time_report().c_str());
  }
}

// ---- ops -------------------------------------------------------------------------------------

void CudaVerifier::embed(const OpEvent& e) {
  const bf16_dev* streams = e.t[0].as<bf16_dev>();
  const int T = tokens_, hc = c_.hc_mult, dim = c_.dim;
  std::vector<float> want(size_t(T) * hc * dim);
  int row = 0;
  for (const ChunkRef& ch : *chunks_)
    for (int t = 0; t < ch.n; ++t, ++row)
      for (int k = 0; k < hc; ++k)
        std::copy_n(w_.embed.data() + size_t(ch.tokens[t]) * dim, dim,
                    want.begin() + (size_t(row) * hc + k) * dim);
  compare_exact("embed", -1, bf16(streams, want.size()), want, {T, hc, dim});
}

std::vector<float> CudaVerifier::collapse_norm_bound(const cpu::HcParams& p,
                                                     const std::vector<float>& in,
                                                     const float* norm,
                                                     const std::vector<float>& want, int T) const {
  const int hc = p.hc, dim = p.dim, n = hc * dim;
  std::vector<Iv> y(size_t(T) * dim);
  parallel_for(T, int64_t(T) * n * hc * 4, [&](int64_t t) {
    std::vector<float> m(hc);
    std::vector<double> pre(hc), dpre(hc);
    std::vector<Iv> y1(dim);
    const float* X = in.data() + size_t(t) * n;
    cpu::hc_mixes(p, X, hc, m.data());
    const double rs = 1.0 / std::sqrt(double(cpu::mean_square(X, n)) + p.norm_eps);
    // pre_j = sigmoid(m_j * scale + base_j) + eps: sigmoid is 1/4-Lipschitz; expf, the add, the
    // division and the eps: 4 roundings on either side.
    for (int j = 0; j < hc; ++j) {
      const double z = double(m[j]) * p.scale[0] + p.base[j];
      const double dz = std::fabs(p.scale[0]) * mix_bound(p, X, j, m[j], rs) +
                        cpu::fp32_ops_bound(2, std::fabs(z) + std::fabs(m[j] * p.scale[0]));
      pre[j] = sigmoid_d(z) + p.hc_eps;
      dpre[j] = 0.25 * dz + cpu::fp32_ops_bound(4, pre[j]);
    }
    // y1 = bf16(sum_j pre_j h_j): 2 hc fp32 roundings, then the BF16 rounding on both ends.
    for (int d = 0; d < dim; ++d) {
      double c = 0, r = 0, mag = 0;
      for (int j = 0; j < hc; ++j) {
        const double h = X[size_t(j) * dim + d];
        c += pre[j] * h;
        r += dpre[j] * std::fabs(h);
        mag += pre[j] * std::fabs(h);
      }
      y1[d] = cpu::round_ends_bf16(Iv::of(c, r + cpu::fp32_ops_bound(2 * hc, mag)));
    }
    rms_norm_interval(y1.data(), dim, norm, c_.norm_eps, y.data() + size_t(t) * dim);
  });
  return interval_bound(y, want);
}

void CudaVerifier::hc_pre(int block, bool ffn, const std::vector<float>& in, const bf16_dev* y,
                          const float* post, const float* comb) {
  const int T = tokens_, hc = c_.hc_mult, dim = c_.dim, n = hc * dim;
  const cpu::BlockWeights& b = bw(block);
  const cpu::HcParams p = hc_params(c_, ffn ? b.hc_ffn : b.hc_attn);
  const float* norm_w = (ffn ? b.ffn_norm : b.attn_norm).data();
  std::vector<float> ey(size_t(T) * dim), ep(size_t(T) * hc), ec(size_t(T) * hc * hc);
  // Token by token over the host's cores (each token's work is independent, and 2048 tokens of
  // 16K-wide streams at real geometry).
  const int64_t token_cost = int64_t(T) * n * (2 + hc) * hc * 2;
  parallel_for(T, token_cost, [&](int64_t t) {
    cpu::hc_pre(p, in.data() + size_t(t) * n, ey.data() + size_t(t) * dim,
                ep.data() + size_t(t) * hc, ec.data() + size_t(t) * hc * hc);
  });
  cpu::rms_norm(ey.data(), T, dim, norm_w, c_.norm_eps, ey.data());
  // post and comb: the mixes' bounds through 2 sigmoid (post) and through Sinkhorn (comb, to
  // first order: its Jacobian by central differences in double, plus 2 (hc + 1) fp32 roundings
  // per normalisation pass on either side, carried by at most the Jacobian's relative gain).
  std::vector<float> bp(ep.size()), bc(ec.size());
  const int K2 = hc * hc, iters = p.sinkhorn_iters;
  parallel_for(T, token_cost, [&](int64_t t) {
    std::vector<float> m((2 + hc) * hc);
    std::vector<double> z(K2), dz(K2), zp(K2), zm(K2), J(size_t(K2) * K2);
    const float* X = in.data() + size_t(t) * n;
    cpu::hc_mixes(p, X, (2 + hc) * hc, m.data());
    const double rs = 1.0 / std::sqrt(double(cpu::mean_square(X, n)) + p.norm_eps);
    for (int j = 0; j < hc; ++j) {
      const double zz = double(m[hc + j]) * p.scale[1] + p.base[hc + j];
      const double d = std::fabs(p.scale[1]) * mix_bound(p, X, hc + j, m[hc + j], rs) +
                       cpu::fp32_ops_bound(2, std::fabs(zz) + std::fabs(m[hc + j] * p.scale[1]));
      bp[size_t(t) * hc + j] =
          static_cast<float>(0.5 * d + cpu::fp32_ops_bound(5, ep[size_t(t) * hc + j]));
    }
    for (int i = 0; i < K2; ++i) {
      z[i] = double(m[2 * hc + i]) * p.scale[2] + p.base[2 * hc + i];
      // expf within 2 ulps: a relative error of exp is an additive one of its argument.
      dz[i] = std::fabs(p.scale[2]) * mix_bound(p, X, 2 * hc + i, m[2 * hc + i], rs) +
              cpu::fp32_ops_bound(2, std::fabs(z[i]) + std::fabs(m[2 * hc + i] * p.scale[2])) +
              4 * 0x1p-24;
    }
    for (int i = 0; i < K2; ++i) {
      const double h = 1e-6 * std::max(1.0, std::fabs(z[i]));
      zp = z;
      zm = z;
      zp[i] += h;
      zm[i] -= h;
      sinkhorn_d(zp.data(), hc, iters, p.hc_eps);
      sinkhorn_d(zm.data(), hc, iters, p.hc_eps);
      for (int k = 0; k < K2; ++k) J[size_t(k) * K2 + i] = (zp[k] - zm[k]) / (2 * h);
    }
    for (int k = 0; k < K2; ++k) {
      const double ck = std::fabs(ec[size_t(t) * K2 + k]);
      double lin = 0, gain = 0;
      for (int i = 0; i < K2; ++i) {
        lin += std::fabs(J[size_t(k) * K2 + i]) * dz[i];
        gain += std::fabs(J[size_t(k) * K2 + i]);
      }
      gain = ck > 0 ? std::max(1.0, gain / ck) : 1.0;
      // 2 iters normalisation passes, hc + 1 roundings each, either side; 10 % for the
      // linearisation and the difference quotient.
      bc[size_t(t) * K2 + k] =
          static_cast<float>(1.1 * (lin + cpu::fp32_ops_bound(2 * iters * (hc + 1), ck) * gain));
    }
  });
  const std::string u = ffn ? "ffn" : "attn";
  judge("hc_pre." + u + " + " + u + "_norm (y)", block, bf16(y, ey.size()), ey,
        collapse_norm_bound(p, in, norm_w, ey, T), cpu::Rounding::kNone, {T, dim});
  judge("hc_pre." + u + " (post)", block, f32(post, ep.size()), ep, bp, cpu::Rounding::kF32,
        {T, hc});
  judge("hc_pre." + u + " (comb)", block, f32(comb, ec.size()), ec, bc, cpu::Rounding::kF32,
        {T, hc, hc});
}

void CudaVerifier::hc_post(const OpEvent& e) {
  const int block = e.block, T = tokens_, hc = c_.hc_mult, dim = c_.dim;
  const bool ffn = e.id != 0;
  const std::vector<float> sub = bf16(e.t[0].as<bf16_dev>(), size_t(T) * dim),
                           res = bf16(e.t[1].as<bf16_dev>(), size_t(T) * hc * dim),
                           post = f32(e.t[2].as<float>(), size_t(T) * hc),
                           comb = f32(e.t[3].as<float>(), size_t(T) * hc * hc);
  const bf16_dev* out = e.t[4].as<bf16_dev>();
  std::vector<float> want(size_t(T) * hc * dim), bound(want.size());
  if (!checks(block)) {  // only the fused hc_pre of the next block (in range)
    hc_pre(e.next_block, e.next_ffn, bf16(out, want.size()), e.t[5].as<bf16_dev>(),
           e.t[6].as<float>(), e.t[7].as<float>());
    return;
  }
  for (int t = 0; t < T; ++t) {
    cpu::hc_post(hc, dim, sub.data() + size_t(t) * dim, res.data() + size_t(t) * hc * dim,
                 post.data() + size_t(t) * hc, comb.data() + size_t(t) * hc * hc,
                 want.data() + size_t(t) * hc * dim);
    // post_k x_d + sum_j comb_jk res_jd on identical inputs: hc + 1 products and hc sums.
    for (int k = 0; k < hc; ++k)
      for (int d = 0; d < dim; ++d) {
        double mag = std::fabs(double(post[size_t(t) * hc + k]) * sub[size_t(t) * dim + d]);
        for (int j = 0; j < hc; ++j)
          mag += std::fabs(double(comb[size_t(t) * hc * hc + j * hc + k]) *
                           res[(size_t(t) * hc + j) * dim + d]);
        bound[(size_t(t) * hc + k) * dim + d] =
            static_cast<float>(cpu::fp32_ops_bound(2 * hc + 1, mag));
      }
  }
  const std::vector<float> got = bf16(out, want.size());
  judge(std::string("hc_post.") + (ffn ? "ffn" : "attn"), block, got, want, bound,
        cpu::Rounding::kBf16, {T, hc, dim});
  // The fused next hc_pre, from the streams the kernel wrote.
  if (e.next_block >= 0 && checks(e.next_block))
    hc_pre(e.next_block, e.next_ffn, got, e.t[5].as<bf16_dev>(), e.t[6].as<float>(),
           e.t[7].as<float>());
}

void CudaVerifier::linear(const OpEvent& e) {
  const int block = e.block, m = int(e.t[0].rows);
  const bf16_dev* x = e.t[0].as<bf16_dev>();
  const int64_t ldx = e.t[0].stride(), ldy = e.t[1].stride();
  const void* y = e.t[1].data;
  const bool y_f32 = e.t[1].dtype == DType::kF32;
  const LinearId which = LinearId(e.id);
  const cpu::Linear* L = &cpu::block_linear(bw(block), which);
  const char* name = op_name(which);
  const std::vector<float> xin = rows_of(*this, x, ldx, m, L->in, false);
  std::vector<float> want(size_t(m) * L->out), bound(want.size());
  cpu::linear(*L, xin.data(), m, want.data());
  // The FP8 linears run on the FP8 tensor cores (the decode stream kernel or the prefill
  // blockwise GEMM, as fp8_linear picks) or, with --exact-linears, on BF16 MMA; the BF16-weight
  // linears (compressor, weights_proj) on cuBLAS's fp32-accumulating BF16 GEMMs.
  cpu::TcSum tc = cpu::kBf16Mma;
  if (L->kind == cpu::LinearKind::kFp8 && !exact_linears_)
    tc = cuda::fp8_gemm_pick_path(m, L->out, L->in) == cuda::Fp8GemmPath::kStream
             ? cpu::kFp8WgmmaSlice
             : cpu::kFp8WgmmaBlock;
  cpu::linear_error_bound(*L, xin.data(), m, tc, bound.data());
  judge(name, block, rows_of(*this, y, ldy, m, L->out, y_f32), want, bound,
        y_f32 ? cpu::Rounding::kF32 : cpu::Rounding::kBf16, {m, L->out});
}

void CudaVerifier::rms_norm(const OpEvent& e) {
  const int block = e.block, rows = int(e.t[0].rows), n = int(e.t[0].cols);
  const bf16_dev *x = e.t[0].as<bf16_dev>(), *y = e.t[1].as<bf16_dev>();
  const NormId which = NormId(e.id);
  const std::vector<float>* w = &cpu::block_norm(bw(block), which);
  const char* name = op_name(which);
  const std::vector<float> xin = bf16(x, size_t(rows) * n);
  std::vector<float> want(xin.size()), bound(xin.size());
  cpu::rms_norm(xin.data(), rows, n, w->data(), c_.norm_eps, want.data());
  // Identical inputs: the sum of squares (n fp32 roundings at most), rs (4) and two products.
  for (size_t i = 0; i < want.size(); ++i)
    bound[i] = static_cast<float>(
        cpu::fp32_ops_bound(n / 2 + 8, std::fabs(want[i]) + cpu::bf16_ulp(want[i])));
  judge(name, block, bf16(y, want.size()), want, bound, cpu::Rounding::kBf16, {rows, n});
}

void CudaVerifier::q_norm_rope(const OpEvent& e) {
  const int block = e.block;
  const std::vector<float>& q_in = q_in_;
  const bf16_dev* q_out = e.t[0].as<bf16_dev>();
  const int T = tokens_, H = c_.n_heads, D = c_.head_dim, R = c_.rope_head_dim;
  const cpu::RopeTable& rope = bw(block).attn.rope;
  std::vector<float> q = q_in, cs(R / 2), sn(R / 2);
  cpu::rms_norm_bf16_weightless(q.data(), T * H, D, c_.norm_eps);
  // The same on intervals: s = sum bf16(x^2) (exact squares, D fp32 roundings of the sum at
  // most), mean = bf16(s / D), t = bf16(mean + eps), rs = bf16(1 / sqrt(t)), bf16(x rs), then
  // RoPE; every rounding on both ends.
  std::vector<Iv> iv(q.size());
  for (int r = 0; r < T * H; ++r) {
    const float* x = q_in.data() + size_t(r) * D;
    double s = 0;
    for (int i = 0; i < D; ++i) s += double(round_bf16(x[i] * x[i]));
    const Iv sum = cpu::widen_f32(Iv::of(s), D);
    const Iv mean = cpu::round_ends_bf16(cpu::widen_f32({sum.lo / D, sum.hi / D}, 1));
    const Iv t = cpu::round_ends_bf16(cpu::widen_f32(mean + Iv::of(c_.norm_eps), 1));
    const Iv rs = cpu::round_ends_bf16(
        cpu::widen_f32({1.0 / std::sqrt(t.hi), 1.0 / std::sqrt(std::max(t.lo, 1e-38))}, 2));
    for (int i = 0; i < D; ++i)
      iv[size_t(r) * D + i] = cpu::round_ends_bf16(cpu::widen_f32(rs * double(x[i]), 1));
  }
  int row = 0;
  for (const ChunkRef& ch : *chunks_)
    for (int t = 0; t < ch.n; ++t, ++row) {
      rope.cos_sin(ch.start + t, cs.data(), sn.data());
      for (int h = 0; h < H; ++h) {
        const size_t o = (size_t(row) * H + h) * D + D - R;
        cpu::rope_apply(q.data() + o, R, cs.data(), sn.data(), false);
        rope_interval(iv.data() + o, R, cs.data(), sn.data(), false);
      }
    }
  judge("attn.q_norm_rope", block, rows_of(*this, q_out, e.t[0].stride(), T, H * D, false), q,
        interval_bound(iv, q), cpu::Rounding::kNone, {T, H, D});
}

void CudaVerifier::kv_entries(const OpEvent& e) {
  const int block = e.block;
  const bf16_dev* kv = e.t[0].as<bf16_dev>();
  const uint8_t* staged = e.t[1].as<uint8_t>();
  const int T = tokens_, D = c_.head_dim, R = c_.rope_head_dim;
  const KvEntryLayout& kl = cache_.kv_layout();
  const int eb = kl.entry_bytes(), db = kl.data_bytes();
  const cpu::AttentionWeights& a = bw(block).attn;
  std::vector<float> x = bf16(kv, size_t(T) * D), cs(R / 2), sn(R / 2);
  std::vector<uint8_t> got = staged ? bytes(staged, size_t(T) * eb) : std::vector<uint8_t>();
  const StoreCopy ring = staged ? StoreCopy{} : copy_store(*this, cache_, block, 0);
  std::vector<uint8_t> want(eb), dev(eb);
  int row = 0;
  for (const ChunkRef& ch : *chunks_)
    for (int t = 0; t < ch.n; ++t, ++row) {
      float* r = x.data() + size_t(row) * D;
      cpu::rms_norm(r, 1, D, a.kv_norm.data(), c_.norm_eps, r);
      a.rope.cos_sin(ch.start + t, cs.data(), sn.data());
      cpu::rope_apply(r + D - R, R, cs.data(), sn.data(), false);
      cpu::encode_kv_entry(kl, r, want.data(), want.data() + db);
      const uint8_t* d;
      if (staged) {
        d = got.data() + size_t(row) * eb;
      } else {
        const EntryRef e = cache_.window_slot(block, *ch.cache, ch.start + t);
        std::copy_n(ring.at(e.data), db, dev.begin());
        std::copy_n(ring.at(e.scales), eb - db, dev.begin() + db);
        d = dev.data();
      }
      compare_entry("attn.kv_norm_rope_quant (window entry)", block, 0, d, d + db, want.data(),
                    want.data() + db, cat("of position ", ch.start + t));
    }
  ++checked_;
}

void CudaVerifier::before_compressor(int block, bool indexer) {
  state_snap_.clear();
  for (const ChunkRef& ch : *chunks_) {
    const int slot = ch.cache->state_slot;
    const CompressorStateLayout l =
        indexer ? cache_.index_state_layout() : cache_.main_state_layout(block);
    state_snap_.push_back(
        f32(indexer ? cache_.index_state(block, slot) : cache_.main_state(block, slot),
            size_t(l.floats())));
  }
}

void CudaVerifier::compressor(const OpEvent& e) {
  const int block = e.block;
  const bool indexer = e.id != 0;
  const float *a = e.t[0].as<float>(), *g = e.t[1].as<float>();
  const int64_t stride = e.t[0].stride();
  const cpu::AttentionWeights& aw = bw(block).attn;
  const cpu::CompressorWeights& w = indexer ? aw.indexer->compressor : *aw.compressor;
  const CompressorStateLayout l =
      indexer ? cache_.index_state_layout() : cache_.main_state_layout(block);
  const int width = l.width(), T = tokens_;
  const std::vector<float> av = rows_of(*this, a, stride, T, width, true);
  const std::vector<float> gv = rows_of(*this, g, stride, T, width, true);
  const std::string op = indexer ? "indexer.compressor" : "compressor";
  const int kind = indexer ? 2 : 1;
  const KvEntryLayout& kl = cache_.kv_layout();
  const IndexKeyLayout& il = cache_.index_layout();
  const int db = indexer ? il.data_bytes() : kl.data_bytes();
  const int sb = indexer ? il.scale_bytes() : kl.scale_bytes();
  std::vector<float> pooled(w.dim), entry(w.dim);
  std::vector<uint8_t> want(db + sb);
  const StoreCopy store = copy_store(*this, cache_, block, kind);
  for (size_t s = 0; s < chunks_->size(); ++s) {
    const ChunkRef& ch = (*chunks_)[s];
    std::vector<float> state = state_snap_.at(s);
    for (int t = 0; t < ch.n; ++t) {
      const int64_t p = ch.start + t;
      const size_t row = size_t(row0_[s] + t) * width;
      cpu::compressor_store(w, l, state.data(), p, av.data() + row, gv.data() + row);
      if ((p + 1) % w.ratio != 0) continue;
      cpu::compressor_pool(w, l, state.data(), pooled.data());
      cpu::compressor_finish(w, aw.rope, c_.norm_eps, p + 1 - w.ratio, pooled.data(), entry.data());
      const int64_t i = (p + 1) / w.ratio - 1;
      EntryRef e;
      if (indexer) {
        cpu::encode_index_key(il, entry.data(), want.data(), want.data() + db);
        e = cache_.index_key(block, *ch.cache, i);
      } else {
        cpu::encode_kv_entry(kl, entry.data(), want.data(), want.data() + db);
        e = cache_.compressed(block, *ch.cache, i);
      }
      compare_entry(op + " (entry)", block, kind, store.at(e.data), store.at(e.scales), want.data(),
                    want.data() + db, cat(i, " of the sequence in batch row ", s));
    }
    const int slot = ch.cache->state_slot;
    const std::vector<float> got =
        f32(indexer ? cache_.index_state(block, slot) : cache_.main_state(block, slot),
            size_t(l.floats()));
    compare_rel_l2(op + " (state)", block, got, state, {2, l.rows(), width}, tol_.state_rel_l2);
  }
}

void CudaVerifier::indexer(const OpEvent& e) {
  const int block = e.block;
  const bf16_dev *qi = e.t[0].as<bf16_dev>(), *wproj = e.t[1].as<bf16_dev>(),
                 *q_fp4 = e.t[2].as<bf16_dev>(), *weights = e.t[3].as<bf16_dev>(),
                 *scores = e.t[4].as<bf16_dev>();
  const int64_t score_stride = e.t[4].stride();
  const int32_t* topk = e.t[5].as<int32_t>();
  const int T = tokens_, HI = c_.index_n_heads, DI = c_.index_head_dim;
  const int R = c_.rope_head_dim, K = c_.index_topk;
  const cpu::AttentionWeights& aw = bw(block).attn;
  // Query path, and the same on intervals: RoPE, the Hadamard rotation (orthonormal, entries
  // +-1/sqrt(DI): a radius r_k of its inputs gives sum_k r_k / sqrt(DI) on every output, its
  // log2(DI) + 1 fp32 stages on either side), BF16 rounding, then the e2m1 fake quantisation of
  // each block at every scale its amax interval allows.
  std::vector<float> q = bf16(qi, size_t(T) * HI * DI), cs(R / 2), sn(R / 2);
  std::vector<float> wv = bf16(wproj, size_t(T) * HI);
  std::vector<Iv> qiv(q.size()), qq(q.size()), rot(DI);
  for (size_t i = 0; i < q.size(); ++i) qiv[i] = Iv::of(q[i]);
  int stages = 1;
  while ((1 << (stages - 1)) < DI) ++stages;
  int row = 0;
  for (const ChunkRef& ch : *chunks_)
    for (int t = 0; t < ch.n; ++t, ++row) {
      aw.rope.cos_sin(ch.start + t, cs.data(), sn.data());
      for (int h = 0; h < HI; ++h) {
        const size_t o = (size_t(row) * HI + h) * DI;
        float* v = q.data() + o;
        Iv* vi = qiv.data() + o;
        cpu::rope_apply(v + DI - R, R, cs.data(), sn.data(), false);
        rope_interval(vi + DI - R, R, cs.data(), sn.data(), false);
        std::vector<double> hd(DI);
        double rad = 0, mag = 0;
        for (int k = 0; k < DI; ++k) {
          hd[k] = vi[k].mid();
          rad += 0.5 * vi[k].width();
          mag += maxabs(vi[k]);
        }
        // The rotation of the midpoints in double (to 2^-50 of sum|x|), then the radius.
        for (int hh = 1; hh < DI; hh *= 2)
          for (int i = 0; i < DI; i += 2 * hh)
            for (int j = i; j < i + hh; ++j) {
              const double a = hd[j], b = hd[j + hh];
              hd[j] = a + b;
              hd[j + hh] = a - b;
            }
        const double sc = 1.0 / std::sqrt(double(DI));
        const double err = (rad + mag * 0x1p-50) * sc + cpu::fp32_ops_bound(stages, mag * sc);
        for (int k = 0; k < DI; ++k) rot[k] = cpu::round_ends_bf16(Iv::of(hd[k] * sc, err));
        cpu::fake_quant_interval(rot.data(), DI, IndexKeyLayout::kQuantBlock, true, qq.data() + o);
        cpu::hadamard_rotate(v, DI);
        cpu::fake_quant_fp4(v, DI, IndexKeyLayout::kQuantBlock, v);
      }
    }
  const float wscale = static_cast<float>(1.0 / std::sqrt(double(DI)) / std::sqrt(double(HI)));
  std::vector<float> bw_bound(wv.size());
  for (size_t i = 0; i < wv.size(); ++i) {
    const float v = wv[i];
    wv[i] = round_bf16(v * wscale);
    // One fp32 product on either side, rounded to BF16 on both ends.
    const Iv e = cpu::round_ends_bf16(cpu::widen_f32(Iv::of(double(v) * wscale), 1));
    bw_bound[i] = static_cast<float>(std::max(e.hi - wv[i], wv[i] - e.lo));
  }
  const std::vector<float> gq = bf16(q_fp4, q.size()), gw = bf16(weights, wv.size());
  judge("indexer.query (q fp4)", block, gq, q, interval_bound(qq, q), cpu::Rounding::kNone,
        {T, HI, DI});
  judge("indexer.query (weights)", block, gw, wv, bw_bound, cpu::Rounding::kNone, {T, HI});

  // Logits over the visible keys (from the GPU's q and weights), then the top-k of the GPU's
  // own scores.
  const IndexKeyLayout& il = cache_.index_layout();
  const std::vector<float> gs = bf16(scores, size_t(T) * score_stride);
  const std::vector<int32_t> gsel = download<int32_t>(topk, size_t(T) * K);
  std::vector<float> got_all, want_all, bound_all;
  const StoreCopy key_store = copy_store(*this, cache_, block, 2);
  for (size_t s = 0; s < chunks_->size(); ++s) {
    const ChunkRef& ch = (*chunks_)[s];
    const int64_t nkeys = (ch.start + ch.n) / 4;
    std::vector<float> keys(size_t(nkeys) * DI);
    for (int64_t i = 0; i < nkeys; ++i) {
      const EntryRef e = cache_.index_key(block, *ch.cache, i);
      cpu::decode_index_key(il, key_store.at(e.data), key_store.at(e.scales),
                            keys.data() + size_t(i) * DI);
    }
    // Each token's scores and their bounds over the host's cores (2048 tokens x 512 keys x 64
    // heads at real geometry), then judged in token order.
    std::vector<std::vector<float>> want_of(size_t(ch.n)), bound_of(size_t(ch.n));
    parallel_for(ch.n, int64_t(ch.n) * nkeys * HI * DI * 4, [&](int64_t t) {
      const int r = row0_[s] + int(t);
      const int nvis = int((ch.start + t + 1) / 4);
      std::vector<float>& want = want_of[size_t(t)];
      std::vector<float>& bound = bound_of[size_t(t)];
      want.resize(nvis);
      bound.resize(nvis);
      cpu::indexer_scores(gq.data() + size_t(r) * HI * DI, gw.data() + size_t(r) * HI, HI, DI,
                          keys.data(), nvis, want.data());
      std::vector<Iv> iv(nvis);
      indexer_interval(gq.data() + size_t(r) * HI * DI, gw.data() + size_t(r) * HI, HI, DI,
                       keys.data(), nvis, iv.data());
      for (int i = 0; i < nvis; ++i)
        bound[i] =
            static_cast<float>(std::max(iv[i].hi - want[i], want[i] - iv[i].lo) * (1 + 0x1p-20));
    });
    for (int t = 0; t < ch.n; ++t) {
      const int r = row0_[s] + t;
      const int nvis = int((ch.start + t + 1) / 4);
      const float* g = gs.data() + size_t(r) * score_stride;
      got_all.insert(got_all.end(), g, g + nvis);
      want_all.insert(want_all.end(), want_of[size_t(t)].begin(), want_of[size_t(t)].end());
      bound_all.insert(bound_all.end(), bound_of[size_t(t)].begin(), bound_of[size_t(t)].end());
      // Top-k on the GPU's scores.
      std::vector<int32_t> cpu_sel(std::min(K, nvis));
      cpu::topk_desc(g, nvis, K, cpu_sel.data());
      const int32_t* gr = gsel.data() + size_t(r) * K;
      const int nsel = int(cpu_sel.size());
      for (int j = nsel; j < K; ++j)
        if (gr[j] != -1)
          fail("indexer.topk", block,
               cat("position ", ch.start + t, ": slot ", j, " holds ", gr[j], " but only ", nvis,
                   " entries are visible (expected -1)"));
      std::set<int32_t> a(gr, gr + nsel), b(cpu_sel.begin(), cpu_sel.end());
      if (a == b) continue;
      const float kth = nsel ? g[cpu_sel[nsel - 1]] : 0.0f;
      for (int32_t e : a)
        if (!b.count(e) && (e < 0 || e >= nvis || g[e] != kth))
          fail("indexer.topk", block,
               cat("position ", ch.start + t, ": the GPU selected entry ", e, " (score ",
                   e >= 0 && e < nvis ? g[e] : NAN, ") which the CPU's top-", K,
                   " of the same scores does not (k-th score ", kth, ")"));
      for (int32_t e : b)
        if (!a.count(e) && g[e] != kth)
          fail("indexer.topk", block,
               cat("position ", ch.start + t, ": the CPU selected entry ", e, " (score ", g[e],
                   ") which the GPU did not (k-th score ", kth, ")"));
    }
  }
  judge("indexer.logits", block, got_all, want_all, bound_all, cpu::Rounding::kNone,
        {int64_t(got_all.size())});
  ++ops_["indexer.topk"].count;
}

void CudaVerifier::attention(const OpEvent& e) {
  const int block = e.block, staging_slots = int(e.t[1].rows);
  const bf16_dev *q = e.t[0].as<bf16_dev>(), *o = e.t[3].as<bf16_dev>();
  const uint8_t* staging = e.t[1].as<uint8_t>();
  const int32_t* topk = e.t[2].as<int32_t>();
  const int T = tokens_, H = c_.n_heads, D = c_.head_dim, W = c_.window_size;
  const int K = c_.index_topk, ratio = c_.ratio(block);
  const cpu::AttentionWeights& aw = bw(block).attn;
  const KvEntryLayout& kl = cache_.kv_layout();
  const int db = kl.data_bytes(), sb = kl.scale_bytes();
  // q and o may hold padding heads beyond the model's (row stride e.t[0/3].stride()).
  const std::vector<float> qv = rows_of(*this, q, e.t[0].stride(), T, H * D, false);
  std::vector<uint8_t> stage;
  if (staging) stage = bytes(staging, size_t(staging_slots) * db + size_t(staging_slots) * sb);
  std::vector<int32_t> sel;
  if (ratio == 4) sel = download<int32_t>(topk, size_t(T) * K);
  const StoreCopy ring = copy_store(*this, cache_, block, 0);
  const StoreCopy comp_store = ratio > 0 ? copy_store(*this, cache_, block, 1) : StoreCopy{};
  auto decode_dev = [&](const StoreCopy& sc, const EntryRef& e, std::vector<float>& out) {
    out.resize(D);
    cpu::decode_kv_entry(kl, sc.at(e.data), sc.at(e.scales), out.data());
  };
  cpu::SparseAttnParams sp;
  sp.n_heads = H;
  sp.head_dim = D;
  sp.softmax_scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  sp.sink = aw.sink.data();
  std::vector<float> want(size_t(T) * H * D);
  std::vector<Iv> oiv(want.size());
  for (size_t s = 0; s < chunks_->size(); ++s) {
    const ChunkRef& ch = (*chunks_)[s];
    const int64_t P0 = ch.start;
    std::map<int64_t, std::vector<float>> win, comp;
    auto window_key = [&](int64_t j) -> const float* {
      auto it = win.find(j);
      if (it != win.end()) return it->second.data();
      std::vector<float>& v = win[j];
      if (staging && j >= P0) {
        const size_t r = size_t(row0_[s] + (j - P0));
        v.resize(D);
        cpu::decode_kv_entry(kl, stage.data() + r * db,
                             stage.data() + size_t(staging_slots) * db + r * sb, v.data());
      } else {
        decode_dev(ring, cache_.window_slot(block, *ch.cache, j), v);
      }
      return v.data();
    };
    auto comp_key = [&](int64_t i) -> const float* {
      auto it = comp.find(i);
      if (it != comp.end()) return it->second.data();
      decode_dev(comp_store, cache_.compressed(block, *ch.cache, i), comp[i]);
      return comp[i].data();
    };
    // Keys decoded once here (the maps' nodes stay put), then each token's attention and its
    // interval over the host's cores: 2048 tokens x 640 keys x 64 heads at real geometry.
    std::vector<std::vector<const float*>> keys_of(size_t(ch.n));
    for (int t = 0; t < ch.n; ++t) {
      const int64_t p = P0 + t;
      const int r = row0_[s] + t;
      std::vector<const float*>& keys = keys_of[size_t(t)];
      keys.assign(W, nullptr);
      const int64_t lo = std::max<int64_t>(0, p - W + 1);
      for (int64_t j = lo; j <= p; ++j) keys[j - lo] = window_key(j);
      if (ratio == 128) {
        for (int64_t i = 0; i < (p + 1) / 128; ++i) keys.push_back(comp_key(i));
      } else if (ratio == 4) {
        for (int j = 0; j < K; ++j) {
          const int32_t i = sel[size_t(r) * K + j];
          keys.push_back(i >= 0 && i < (p + 1) / 4 ? comp_key(i) : nullptr);
        }
      }
    }
    parallel_for(ch.n, int64_t(ch.n) * (W + K) * H * D * 8, [&](int64_t t) {
      const int r = row0_[s] + int(t);
      const std::vector<const float*>& keys = keys_of[size_t(t)];
      cpu::sparse_attention(sp, qv.data() + size_t(r) * H * D, keys.data(), int(keys.size()),
                            want.data() + size_t(r) * H * D);
      cpu::attention_interval(sp, qv.data() + size_t(r) * H * D, keys.data(), int(keys.size()),
                              oiv.data() + size_t(r) * H * D);
    });
  }
  last_o_ = rows_of(*this, o, e.t[3].stride(), T, H * D, false);
  last_o_block_ = block;
  judge("attn.sparse_attention", block, last_o_, want, interval_bound(oiv, want),
        cpu::Rounding::kNone, {T, H, D});
}

void CudaVerifier::wo_a(const OpEvent& e) {
  const int block = e.block;
  const bf16_dev* z = e.t[0].as<bf16_dev>();
  DSV4_CHECK(last_o_block_ == block, "verify: wo_a without its attention output");
  const int T = tokens_, H = c_.n_heads, D = c_.head_dim, R = c_.rope_head_dim;
  const int G = c_.o_groups, OL = c_.o_lora_rank, in_g = c_.heads_per_group() * D;
  const cpu::AttentionWeights& aw = bw(block).attn;
  std::vector<float> o = last_o_, cs(R / 2), sn(R / 2);
  // The inverse RoPE's BF16 roundings on intervals: an input known to within dx adds
  // sum_k |w_kn| dx_k to the GEMM's bound (BF16 MMA model).
  std::vector<Iv> oiv(o.size());
  for (size_t i = 0; i < o.size(); ++i) oiv[i] = Iv::of(o[i]);
  int row = 0;
  for (const ChunkRef& ch : *chunks_)
    for (int t = 0; t < ch.n; ++t, ++row) {
      aw.rope.cos_sin(ch.start + t, cs.data(), sn.data());
      for (int h = 0; h < H; ++h) {
        const size_t off = (size_t(row) * H + h) * D + D - R;
        cpu::rope_apply(o.data() + off, R, cs.data(), sn.data(), true);
        rope_interval(oiv.data() + off, R, cs.data(), sn.data(), true);
      }
    }
  std::vector<float> want(size_t(T) * G * OL), bound(want.size()), og(size_t(T) * in_g),
      zg(size_t(T) * OL), bg(zg.size());
  std::vector<double> dx(og.size());
  for (int g = 0; g < G; ++g) {
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < in_g; ++k) {
        const size_t src = size_t(t) * H * D + size_t(g) * in_g + k;
        og[size_t(t) * in_g + k] = o[src];
        dx[size_t(t) * in_g + k] = std::max(oiv[src].hi - o[src], o[src] - oiv[src].lo);
      }
    cpu::linear(aw.wo_a[g], og.data(), T, zg.data());
    cpu::linear_error_bound(aw.wo_a[g], og.data(), T, cpu::kBf16Mma, bg.data());
    add_input_spread(aw.wo_a[g], dx, T, bg);
    for (int t = 0; t < T; ++t) {
      std::copy_n(zg.data() + size_t(t) * OL, OL,
                  want.data() + size_t(t) * G * OL + size_t(g) * OL);
      std::copy_n(bg.data() + size_t(t) * OL, OL,
                  bound.data() + size_t(t) * G * OL + size_t(g) * OL);
    }
  }
  judge("attn.wo_a (inverse RoPE + grouped BF16)", block, bf16(z, want.size()), want, bound,
        cpu::Rounding::kBf16, {T, G, OL});
}

void CudaVerifier::window_insert(const OpEvent& e) {
  const int block = e.block;
  const uint8_t* staged = e.t[0].as<uint8_t>();
  const KvEntryLayout& kl = cache_.kv_layout();
  const int eb = kl.entry_bytes(), db = kl.data_bytes(), W = c_.window_size;
  const std::vector<uint8_t> src = bytes(staged, size_t(tokens_) * eb);
  const StoreCopy ring = copy_store(*this, cache_, block, 0);
  for (size_t s = 0; s < chunks_->size(); ++s) {
    const ChunkRef& ch = (*chunks_)[s];
    for (int t = std::max(0, ch.n - W); t < ch.n; ++t) {
      const EntryRef e = cache_.window_slot(block, *ch.cache, ch.start + t);
      const uint8_t* want = src.data() + size_t(row0_[s] + t) * eb;
      if (!std::equal(want, want + db, ring.at(e.data)) ||
          !std::equal(want + db, want + eb, ring.at(e.scales)))
        fail("attn.window_insert", block,
             cat("the ring slot of position ", ch.start + t,
                 " does not hold the staged entry of that token"));
    }
  }
  ++ops_["attn.window_insert"].count;
  ++checked_;
}

void CudaVerifier::swiglu(const OpEvent& e) {
  const int block = e.block, rows = int(e.t[0].rows), inter = int(e.t[1].cols);
  const bf16_dev *gu = e.t[0].as<bf16_dev>(), *act = e.t[1].as<bf16_dev>();
  const int64_t ld = e.t[0].stride();
  const std::vector<float> in = rows_of(*this, gu, ld, rows, 2 * inter, false);
  const float L = c_.swiglu_limit;
  std::vector<float> want(size_t(rows) * inter), bound(want.size());
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < inter; ++i) {
      float g = in[size_t(r) * 2 * inter + i], u = in[size_t(r) * 2 * inter + inter + i];
      if (L > 0) {
        u = std::clamp(u, -L, L);
        g = std::min(g, L);
      }
      const float v = g / (1.0f + std::exp(-g)) * u;
      want[size_t(r) * inter + i] = round_bf16(v);
      // Identical inputs: exp within (2 + 1.2 |g|) fp32 ulps (expf or __expf), the add, the
      // division and the product, on either side.
      bound[size_t(r) * inter + i] =
          static_cast<float>(2 * (2 + 1.2 * std::fabs(g)) * 0x1p-23 * std::fabs(v) +
                             cpu::fp32_ops_bound(3, std::fabs(v)));
    }
  judge("shared_expert.swiglu", block, bf16(act, want.size()), want, bound, cpu::Rounding::kBf16,
        {rows, inter});
}

void CudaVerifier::moe(const OpEvent& e) {
  const int block = e.block;
  const bf16_dev *x = e.t[0].as<bf16_dev>(), *shared = e.t[1].as<bf16_dev>(),
                 *y = e.t[4].as<bf16_dev>();
  const int32_t* sel = e.t[2].as<int32_t>();
  const float* wt = e.t[3].as<float>();
  const int T = tokens_, dim = c_.dim, K = c_.n_activated_experts;
  const cpu::MoeWeights& mw = bw(block).ffn;
  const int E = mw.n_experts(), NE = mw.gate.out;
  const std::vector<float> xv = bf16(x, size_t(T) * dim), sh = bf16(shared, size_t(T) * dim);
  const std::vector<int32_t> gsel = download<int32_t>(sel, size_t(T) * K);
  const std::vector<float> gwt = f32(wt, size_t(T) * K);
  cpu::MoeParams mp;
  mp.top_k = K;
  mp.score_func = c_.score_func;
  mp.route_scale = c_.route_scale;
  mp.swiglu_limit = c_.swiglu_limit;
  std::vector<int32_t> rsel(size_t(T) * K), tokens;
  std::vector<float> rwt(size_t(T) * K);
  std::vector<double> rdw(size_t(T) * K);
  for (const ChunkRef& ch : *chunks_) tokens.insert(tokens.end(), ch.tokens, ch.tokens + ch.n);
  // Each row's routing, router logits (fp32 dot products of dim terms) and the scores' bounds
  // from them, over the host's cores; judged row by row below.
  std::vector<std::vector<double>> sc_of(static_cast<size_t>(T)), dsc_of(static_cast<size_t>(T));
  parallel_for(T, int64_t(T) * NE * dim * 3, [&](int64_t r) {
    const float* xr = xv.data() + size_t(r) * dim;
    cpu::moe_route(mw, mp, xr, tokens[size_t(r)], rsel.data() + size_t(r) * K,
                   rwt.data() + size_t(r) * K);
    std::vector<float> logits(NE);
    std::vector<double> dl(NE);
    cpu::linear(mw.gate, xr, 1, logits.data());
    for (int j = 0; j < NE; ++j) {
      double sabs = 0;
      for (int d = 0; d < dim; ++d)
        sabs += std::fabs(double(xr[d]) * mw.gate.wt[size_t(d) * NE + j]);
      dl[j] = cpu::dot_error_bound(dim, sabs);
    }
    scores_with_bound(mp.score_func, logits, dl, sc_of[size_t(r)], dsc_of[size_t(r)]);
  });
  std::vector<float> cmp_got, cmp_want, cmp_bound;
  for (int r = 0; r < T; ++r) {
    int32_t* e = rsel.data() + size_t(r) * K;
    float* w = rwt.data() + size_t(r) * K;
    const std::vector<double>& sc = sc_of[size_t(r)];
    const std::vector<double>& dsc = dsc_of[size_t(r)];
    const int32_t* g = gsel.data() + size_t(r) * K;
    const float* gw = gwt.data() + size_t(r) * K;
    // The GPU may list the selection in another order: compare as multisets, weights by expert.
    const bool same = std::multiset<int32_t>(e, e + K) == std::multiset<int32_t>(g, g + K);
    if (!same) {
      // Different sets are allowed only where the router's scores (fp32 on the GPU, summed in
      // another order than the CPU's) are a near tie with the k-th: the GPU-only experts'
      // biased scores within 1e-5 (relative) of the CPU's k-th, as the MoE kernel tests allow.
      // The expected output then takes the GPU's selection.
      if (!mw.tid2eid.empty())
        fail("moe.route", block, cat("hash-routed row ", r, ": GPU experts differ from tid2eid"));
      std::vector<double> biased(sc);
      if (!mw.bias.empty())
        for (size_t i = 0; i < biased.size(); ++i) biased[i] += mw.bias[i];
      const double kth = biased[e[K - 1]];
      const std::set<int32_t> cpu_set(e, e + K);
      for (int i = 0; i < K; ++i) {
        const int32_t x_e = g[i];
        if (x_e < 0 || x_e >= int(biased.size()))
          fail("moe.route", block, cat("row ", r, ": the GPU selected expert id ", x_e));
        if (!cpu_set.count(x_e) &&
            std::fabs(biased[x_e] - kth) > 1e-5 * std::max(1.0, std::fabs(kth)))
          fail(
              "moe.route", block,
              cat("row ", r, ": the GPU selected expert ", x_e, " (biased score ", biased[x_e],
                  ") which the CPU router does not; its k-th score is ", kth, " (not a near tie)"));
      }
      ++route_flips_;
      std::copy(g, g + K, e);
      double sum = 0;
      for (int i = 0; i < K; ++i) sum += sc[e[i]];
      for (int i = 0; i < K; ++i)
        w[i] = static_cast<float>(
            (mp.score_func == ScoreFunc::kSoftmax ? sc[e[i]] : sc[e[i]] / sum) * mp.route_scale);
    }
    // Weights s_i / sum_sel s (or s_i for softmax) x route_scale: relative bounds add.
    double ssum = 0, dsum = 0;
    for (int i = 0; i < K; ++i) ssum += sc[e[i]], dsum += dsc[e[i]];
    for (int i = 0; i < K; ++i) {
      const double wi = std::fabs(w[i]);
      rdw[size_t(r) * K + i] =
          mp.score_func == ScoreFunc::kSoftmax
              ? dsc[e[i]] * std::fabs(mp.route_scale) + cpu::fp32_ops_bound(1, wi)
              : wi * (dsc[e[i]] / sc[e[i]] + dsum / ssum) + cpu::fp32_ops_bound(K + 2, wi);
    }
    if (same)
      for (int i = 0; i < K; ++i) {
        const int j = int(std::find(g, g + K, e[i]) - g);
        cmp_got.push_back(gw[j]);
        cmp_want.push_back(w[i]);
        cmp_bound.push_back(static_cast<float>(rdw[size_t(r) * K + i]));
      }
  }
  judge("moe.route (weights)", block, cmp_got, cmp_want, cmp_bound, cpu::Rounding::kF32,
        {int64_t(cmp_got.size())});
  // Routed experts (cpu::expert_forward on intervals, with the shared expert's output taken
  // from the GPU): gate/up by the BF16 MMA model around their exact sums and rounded to BF16,
  // SwiGLU and the routing weight (within its bound) on intervals, BF16 and the e4m3 fake
  // quantisation on both ends, then w2's bound on the CPU's quantised input plus sum |w2| x the
  // width of each input's interval, and each expert output's BF16 rounding.
  std::vector<std::vector<int>> rows_of_e(E), slot_of_e(E);
  for (int r = 0; r < T; ++r)
    for (int i = 0; i < K; ++i) {
      const int32_t e = rsel[size_t(r) * K + i];
      if (!rows_of_e[e].empty() && rows_of_e[e].back() == r) continue;
      rows_of_e[e].push_back(r);
      slot_of_e[e].push_back(i);
    }
  const float L = mp.swiglu_limit;
  const double kSiluMinAt = -1.2784645427610738, kSiluMin = -0.2784645427610738;
  auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
  std::vector<float> out(size_t(T) * K * dim, 0.0f), bout(out.size(), 0.0f), xe, ye, by;
  std::vector<char> used(size_t(T) * K, 0);
  for (int e = 0; e < E; ++e) {
    const int m = static_cast<int>(rows_of_e[e].size());
    if (!m) continue;
    const cpu::ExpertWeights& ew = mw.expert(e);
    const int inter = ew.w1.out;
    xe.resize(size_t(m) * dim);
    ye.resize(size_t(m) * dim);
    by.resize(size_t(m) * dim);
    for (int j = 0; j < m; ++j)
      std::copy_n(xv.data() + size_t(rows_of_e[e][j]) * dim, dim, xe.begin() + size_t(j) * dim);
    std::vector<float> g(size_t(m) * inter), u(g.size()), bg(g.size()), bu(g.size()), act(g.size()),
        q(g.size());
    cpu::linear(ew.w1, xe.data(), m, g.data());
    cpu::linear(ew.w3, xe.data(), m, u.data());
    std::vector<double> g_exact(g.size()), u_exact(g.size());
    cpu::linear_error_bound(ew.w1, xe.data(), m, cpu::kBf16Mma, bg.data(), g_exact.data());
    cpu::linear_error_bound(ew.w3, xe.data(), m, cpu::kBf16Mma, bu.data(), u_exact.data());
    std::vector<Iv> v(g.size()), qv(g.size());
    parallel_for(m, int64_t(m) * inter * 64, [&](int64_t j) {
      const size_t ws = size_t(rows_of_e[e][size_t(j)]) * K + slot_of_e[e][size_t(j)];
      const double we = rwt[ws];
      const Iv W = Iv::of(we, rdw[ws]);
      for (int i = 0; i < inter; ++i) {
        const size_t o = size_t(j) * inter + i;
        float gi = g[o], ui = u[o];
        // Both sides round the gate/up sums to BF16 before the SwiGLU.
        Iv G = cpu::round_ends_bf16(Iv::of(g_exact[o], bg[o]));
        Iv U = cpu::round_ends_bf16(Iv::of(u_exact[o], bu[o]));
        if (L > 0) {
          ui = std::clamp(ui, -L, L);
          gi = std::min(gi, L);
          U = {std::clamp(U.lo, -double(L), double(L)), std::clamp(U.hi, -double(L), double(L))};
          G = {std::min(G.lo, double(L)), std::min(G.hi, double(L))};
        }
        act[o] = round_bf16(float(we) * (gi / (1.0f + std::exp(-gi)) * ui));
        Iv S{std::min(silu(G.lo), silu(G.hi)), std::max(silu(G.lo), silu(G.hi))};
        if (G.contains(kSiluMinAt)) S.lo = kSiluMin;
        // exp within (2 + 1.2 |g|) fp32 ulps, then the add and the division, either side.
        S = cpu::widen(
            S, 2 * (2 + 1.2 * maxabs(G)) * 0x1p-23 * maxabs(S) + cpu::fp32_ops_bound(2, maxabs(S)));
        v[o] = cpu::round_ends_bf16(cpu::widen_f32(cpu::widen_f32(S * U, 1) * W, 1));
      }
    });
    for (int j = 0; j < m; ++j) {
      cpu::fake_quant_interval(v.data() + size_t(j) * inter, inter, 128, false,
                               qv.data() + size_t(j) * inter);
      cpu::fake_quant_fp8(act.data() + size_t(j) * inter, inter, 128, q.data() + size_t(j) * inter);
    }
    std::vector<double> dq(q.size());
    for (size_t i = 0; i < q.size(); ++i) dq[i] = std::max(qv[i].hi - q[i], q[i] - qv[i].lo);
    cpu::linear(ew.w2, act.data(), m, ye.data());
    cpu::linear_error_bound(ew.w2, act.data(), m, cpu::kBf16Mma, by.data());
    add_input_spread(ew.w2, dq, m, by);
    for (int j = 0; j < m; ++j) {
      const size_t o = size_t(rows_of_e[e][j]) * K + slot_of_e[e][j];
      std::copy_n(ye.begin() + size_t(j) * dim, dim, out.begin() + o * dim);
      std::copy_n(by.begin() + size_t(j) * dim, dim, bout.begin() + o * dim);
      used[o] = 1;
    }
  }
  // Combine: fp32 sum of the row's experts in ascending expert index, plus the shared output.
  std::vector<float> want(size_t(T) * dim), bound(want.size());
  cpu::moe_combine(rsel.data(), K, out.data(), used.data(), sh.data(), T, dim, want.data());
  for (int r = 0; r < T; ++r)
    for (int d = 0; d < dim; ++d) {
      double b = 0, mag = std::fabs(sh[size_t(r) * dim + d]);
      for (int i = 0; i < K; ++i) {
        const size_t o = size_t(r) * K + i;
        if (!used[o]) continue;
        // Each expert's output is rounded to BF16 on both sides: half an ulp each.
        const double bo = bout[o * dim + d], yo = std::fabs(out[o * dim + d]);
        b += bo + cpu::bf16_ulp(yo + bo);
        mag += yo + bo;
      }
      bound[size_t(r) * dim + d] = static_cast<float>(b + cpu::fp32_ops_bound(K + 1, mag));
    }
  judge("moe (routed experts + shared)", block, bf16(y, want.size()), want, bound,
        cpu::Rounding::kBf16, {T, dim});
}

void CudaVerifier::hc_head(const OpEvent& e) {
  const int mtp = e.id, rows = int(e.t[0].rows);
  const bf16_dev *streams = e.t[0].as<bf16_dev>(), *y = e.t[1].as<bf16_dev>();
  const int hc = c_.hc_mult, dim = c_.dim;
  const cpu::HcWeights& hw = mtp < 0 ? w_.hc_head : bw(c_.n_layers + mtp).mtp->hc_head;
  const std::vector<float>& norm = mtp < 0 ? w_.norm : bw(c_.n_layers + mtp).mtp->norm;
  const cpu::HcParams p = hc_params(c_, hw);
  const std::vector<float> in = bf16(streams, size_t(rows) * hc * dim);
  std::vector<float> want(size_t(rows) * dim);
  for (int t = 0; t < rows; ++t)
    cpu::hc_head(p, in.data() + size_t(t) * hc * dim, want.data() + size_t(t) * dim);
  cpu::rms_norm(want.data(), rows, dim, norm.data(), c_.norm_eps, want.data());
  judge("hc_head + norm", mtp < 0 ? -1 : c_.n_layers + mtp, bf16(y, want.size()), want,
        collapse_norm_bound(p, in, norm.data(), want, rows), cpu::Rounding::kNone, {rows, dim});
}

void CudaVerifier::logits(const OpEvent& e) {
  const int rows = int(e.t[0].rows);
  const bf16_dev* y = e.t[0].as<bf16_dev>();
  const float* logits = e.t[1].as<float>();
  const std::vector<float> in = bf16(y, size_t(rows) * c_.dim);
  std::vector<float> want(size_t(rows) * c_.vocab_size), bound(want.size());
  cpu::linear(w_.head, in.data(), rows, want.data());
  cpu::linear_error_bound(w_.head, in.data(), rows, cpu::kBf16Mma, bound.data());
  judge("head (logits)", -1, f32(logits, want.size()), want, bound, cpu::Rounding::kF32,
        {rows, c_.vocab_size});
}

void CudaVerifier::mtp_combine(const OpEvent& ev) {
  const bf16_dev *ep = ev.t[0].as<bf16_dev>(), *hp = ev.t[1].as<bf16_dev>(),
                 *x = ev.t[2].as<bf16_dev>();
  const int T = tokens_, hc = c_.hc_mult, dim = c_.dim;
  const std::vector<float> e = bf16(ep, size_t(T) * dim), h = bf16(hp, size_t(T) * hc * dim);
  std::vector<float> want(h.size());
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < hc; ++k)
      for (int d = 0; d < dim; ++d) {
        const size_t i = (size_t(t) * hc + k) * dim + d;
        want[i] = round_bf16(e[size_t(t) * dim + d] + h[i]);
      }
  compare_exact("mtp.combine (e_proj + h_proj)", c_.n_layers, bf16(x, want.size()), want,
                {T, hc, dim});
}

}  // namespace dsv4
