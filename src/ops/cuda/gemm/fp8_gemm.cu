// Host API of the FP8 GEMM (fp8_gemm.h): validation and dispatch between the streaming kernel
// (stream_gemm.cuh) and the CUTLASS tensor-core kernel (fp8_gemm_prefill.cu).
#include "ops/cuda/gemm/fp8_gemm.h"

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/gemm/fp8_gemm_heuristic.h"
#include "ops/cuda/gemm/fp8_gemm_prefill.h"
#include "ops/cuda/gemm/stream_gemm.h"

namespace dsv4::cuda {
namespace {

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

Fp8GemmPath resolve(Fp8GemmPath path, int m, int n, int k) {
  return path == Fp8GemmPath::kAuto ? fp8_gemm_pick_path(m, n, k) : path;
}

detail::PrefillArgs prefill_args(const Fp8GemmParams& p) {
  detail::PrefillArgs a;
  a.a = p.a_codes;
  a.a_scales_t = p.a_scales_t;
  a.a_ld = p.a_ld_scales;
  a.w = p.w.codes;
  a.w_scales_t = p.w.scales_t;
  a.y = p.y;
  a.ldy = p.ldy ? p.ldy : p.w.n;
  a.m = p.m;
  a.n = p.w.n;
  a.k = p.w.k;
  // CUTLASS is built without grid-dependency control (CUTLASS_ENABLE_GDC_FOR_SM90): its kernels
  // would not wait for the producer of A, so they are never launched programmatically.
  a.pdl = false;
  return a;
}

// Bytes of the quantised activations inside fp8_linear's workspace, 256-byte aligned parts.
size_t align256(size_t b) {
  return (b + 255) / 256 * 256;
}
size_t act_bytes(int m, int k) {
  return align256(size_t(m) * k) + align256(size_t(k / 128) * fp8_scale_ld(m) * sizeof(float));
}

// Shape, pointer and alignment checks every path needs (m >= 1).
void check_gemm_operands(const Fp8GemmParams& p) {
  const int m = p.m, n = p.w.n, k = p.w.k;
  const int64_t ldy = p.ldy ? p.ldy : n;
  DSV4_CHECK(ldy >= n, "fp8_gemm: ldy ", ldy, " < n ", n);
  DSV4_CHECK(p.a_codes && p.a_scales_t && p.w.codes && p.w.scales_t && p.y,
             "fp8_gemm: null pointer");
  DSV4_CHECK(aligned16(p.a_codes) && aligned16(p.a_scales_t) && aligned16(p.w.codes) &&
                 aligned16(p.w.scales_t),
             "fp8_gemm: operands and scales must be 16-byte aligned");
  DSV4_CHECK(p.a_ld_scales >= m && p.a_ld_scales % 4 == 0, "fp8_gemm: a_ld_scales ", p.a_ld_scales,
             " must be >= m (", m, ") and a multiple of 4");
  DSV4_CHECK(n > 0 && k > 0 && k % 128 == 0, "fp8_gemm: shape m=", m, " n=", n, " k=", k,
             " (k must be a positive multiple of 128)");
}

}  // namespace

size_t fp8_gemm_workspace_bytes(int m, int n, int k, Fp8GemmPath path) {
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  if (resolve(path, m, n, k) == Fp8GemmPath::kStream) return 0;
  detail::PrefillArgs a;
  a.m = m;
  a.n = n;
  a.k = k;
  a.a_ld = fp8_scale_ld(m);
  a.ldy = n;
  return detail::prefill_workspace_bytes(a);
}

void fp8_gemm(const Fp8GemmParams& p, cudaStream_t stream) {
  const int m = p.m, n = p.w.n, k = p.w.k;
  DSV4_CHECK(m >= 0 && n > 0 && k > 0 && k % 128 == 0, "fp8_gemm: shape m=", m, " n=", n, " k=", k,
             " (k must be a positive multiple of 128)");
  if (m == 0) return;
  const int64_t ldy = p.ldy ? p.ldy : n;
  check_gemm_operands(p);
  const Fp8GemmPath path = resolve(p.path, m, n, k);
  if (path == Fp8GemmPath::kStream) {
    DSV4_CHECK(m <= gemm_cfg::kStreamMaxM,
               "fp8_gemm: the streaming kernel takes m <= ", gemm_cfg::kStreamMaxM, ", got ", m);
    detail::StreamGemmLaunch s;
    s.w = p.w.codes;
    s.n = n;
    s.k = k;
    s.a = p.a_codes;
    s.lda = k;
    s.m = m;
    s.a_scales_t = p.a_scales_t;
    s.a_ld = p.a_ld_scales;
    s.w_scales_t = p.w.scales_t;
    s.out = p.y;
    s.ldo = ldy;
    s.pdl = p.pdl;
    detail::stream_gemm_fp8(s, stream);
    DSV4_CUDA_CHECK(cudaGetLastError());
    return;
  }
  DSV4_CHECK(n % 8 == 0 && ldy % 8 == 0 && aligned16(p.y),
             "fp8_gemm: the tensor-core path (m = ", m,
             ") needs n and ldy multiples of 8 and a 16-byte aligned y; got n=", n, " ldy=", ldy);
  detail::prefill_gemm(prefill_args(p), p.workspace, p.workspace_bytes, stream);
}

void fp8_gemm_grouped(const Fp8GemmGroupedParams& p, cudaStream_t stream) {
  static_assert(Fp8GemmGroupedParams::kMaxGroups == gemm_cfg::kStreamMaxGroups);
  DSV4_CHECK(p.count >= 1 && p.count <= Fp8GemmGroupedParams::kMaxGroups,
             "fp8_gemm_grouped: ", p.count, " weights (1..", Fp8GemmGroupedParams::kMaxGroups, ")");
  const int m = p.m, k = p.w[0].k;
  DSV4_CHECK(m >= 0, "fp8_gemm_grouped: m = ", m);
  if (m == 0) return;
  Fp8GemmParams one[Fp8GemmGroupedParams::kMaxGroups];
  for (int g = 0; g < p.count; ++g) {
    DSV4_CHECK(p.w[g].k == k, "fp8_gemm_grouped: weight ", g, " has k = ", p.w[g].k,
               ", weight 0 has ", k, " (one input)");
    Fp8GemmParams& o = one[g];
    o.a_codes = p.a_codes;
    o.a_scales_t = p.a_scales_t;
    o.a_ld_scales = p.a_ld_scales;
    o.m = m;
    o.w = p.w[g];
    o.y = p.y[g];
    o.ldy = p.ldy[g];
    o.workspace = p.workspace;
    o.workspace_bytes = p.workspace_bytes;
    o.path = p.path;
    // A weight launched alone follows the previous GEMM, which waited for the input's producer.
    o.pdl = p.pdl;
  }
  // One streaming launch when every weight streams and the launch pays (a forced split always
  // groups: tests compare it with the weights alone at that split); else each weight alone.
  bool all_stream = true;
  int tiles[Fp8GemmGroupedParams::kMaxGroups];
  for (int g = 0; g < p.count; ++g) {
    all_stream = all_stream && resolve(p.path, m, p.w[g].n, k) == Fp8GemmPath::kStream;
    tiles[g] = (p.w[g].n + gemm_cfg::kStreamRows - 1) / gemm_cfg::kStreamRows;
  }
  DSV4_CHECK(p.splits == 0 || all_stream, "fp8_gemm_grouped: a forced split (", p.splits,
             ") needs every weight on the streaming path");
  const bool grouped =
      all_stream && (p.splits > 0 || p.count == 1 ||
                     plan_stream_grouping(tiles, p.count, k / gemm_cfg::kStreamStepBytes,
                                          detail::stream_residency_fp8())
                         .grouped);
  if (p.only >= 0) {
    DSV4_CHECK(p.only < p.count, "fp8_gemm_grouped: weight ", p.only, " of ", p.count);
    if (!grouped) return fp8_gemm(one[p.only], stream);
    int all = 0;
    for (int g = 0; g < p.count; ++g) all += tiles[g];
    Fp8GemmGroupedParams q = p;
    q.count = 1;
    q.only = -1;
    q.w[0] = p.w[p.only];
    q.y[0] = p.y[p.only];
    q.ldy[0] = p.ldy[p.only];
    q.splits = p.splits > 0 ? p.splits
                            : plan_stream_tiles(m, all, k / gemm_cfg::kStreamStepBytes,
                                                detail::stream_residency_fp8())
                                  .splits;
    return fp8_gemm_grouped(q, stream);
  }
  if (!grouped) {
    for (int g = 0; g < p.count; ++g) fp8_gemm(one[g], stream);
    return;
  }
  DSV4_CHECK(m <= gemm_cfg::kStreamMaxM,
             "fp8_gemm_grouped: the streaming kernel takes m <= ", gemm_cfg::kStreamMaxM, ", got ",
             m);
  detail::StreamGemmLaunch s;
  s.k = k;
  s.a = p.a_codes;
  s.lda = k;
  s.m = m;
  s.a_scales_t = p.a_scales_t;
  s.a_ld = p.a_ld_scales;
  s.more = p.count - 1;
  s.pdl = p.pdl;
  s.splits = p.splits;
  for (int g = 0; g < p.count; ++g) {
    const Fp8GemmParams& o = one[g];
    check_gemm_operands(o);
    const int64_t ldy = o.ldy ? o.ldy : o.w.n;
    if (g == 0) {
      s.w = o.w.codes;
      s.n = o.w.n;
      s.w_scales_t = o.w.scales_t;
      s.out = o.y;
      s.ldo = ldy;
    } else {
      detail::StreamGemmWeight& w = s.more_w[g - 1];
      w.w = o.w.codes;
      w.n = o.w.n;
      w.w_scales_t = o.w.scales_t;
      w.out = o.y;
      w.ldo = ldy;
    }
  }
  detail::stream_gemm_fp8(s, stream);
  DSV4_CUDA_CHECK(cudaGetLastError());
}

size_t fp8_linear_workspace_bytes(int m, int n, int k, Fp8GemmPath path) {
  if (m <= 0 || k <= 0) return 0;
  return act_bytes(m, k) + align256(fp8_gemm_workspace_bytes(m, n, k, path));
}

size_t fp8_linear_workspace_bytes_upto(int m_max, int n, int k) {
  // Workspace grows with m except for the tensor-core kernel's stream-K partials, which depend on
  // the number of 128-row tiles: take the largest m of every tile count, on the tensor-core path
  // (from 65 to 256 rows the path depends on m; the streaming kernel needs no GEMM workspace).
  size_t best = fp8_linear_workspace_bytes(m_max, n, k);
  for (int m = gemm_cfg::kStreamMaxTokens + 1; m <= m_max; m += gemm_cfg::kPrefillTileM) {
    const int m_top = std::min(m_max, (m + gemm_cfg::kPrefillTileM - 1) / gemm_cfg::kPrefillTileM *
                                          gemm_cfg::kPrefillTileM);
    best = std::max(best, fp8_linear_workspace_bytes(m_top, n, k, Fp8GemmPath::kTensorCore));
  }
  return best;
}

void fp8_linear(const Fp8LinearParams& p, cudaStream_t stream) {
  const int m = p.m, n = p.w.n, k = p.w.k;
  DSV4_CHECK(m >= 0 && n > 0 && k > 0 && k % 128 == 0, "fp8_linear: shape m=", m, " n=", n,
             " k=", k);
  if (m == 0) return;
  const size_t need = fp8_linear_workspace_bytes(m, n, k, p.path);
  DSV4_CHECK(p.workspace && p.workspace_bytes >= need && aligned16(p.workspace),
             "fp8_linear: workspace of ", p.workspace_bytes, " bytes (16-byte aligned) needed ",
             need);
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  ActQuantParams q;
  q.x = p.x;
  q.m = m;
  q.k = k;
  q.ldx = p.ldx;
  q.codes = ws;
  q.scales_t = reinterpret_cast<float*>(ws + align256(size_t(m) * k));
  q.ld_scales = fp8_scale_ld(m);
  quantize_act_fp8(q, stream);
  Fp8GemmParams g;
  g.a_codes = q.codes;
  g.a_scales_t = q.scales_t;
  g.a_ld_scales = q.ld_scales;
  g.m = m;
  g.w = p.w;
  g.y = p.y;
  g.ldy = p.ldy;
  g.workspace = ws + act_bytes(m, k);
  g.workspace_bytes = p.workspace_bytes - act_bytes(m, k);
  // The quantisation kernel is the one just before: the GEMM may overlap its weight loads.
  g.pdl = true;
  g.path = p.path;
  fp8_gemm(g, stream);
}

}  // namespace dsv4::cuda
