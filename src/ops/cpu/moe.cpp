#include "ops/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/formats.h"

namespace dsv4::cpu {
float moe_score(ScoreFunc f, float logit) {
  // exp and log1p are evaluated in double and rounded once: each fp32 operation of the formula
  // is then correctly rounded (but for ~1e-8 of the inputs), which libm's float versions are
  // not everywhere, and the CUDA router computes the same bits the same way.
  const auto exp_rn = [](float v) { return static_cast<float>(std::exp(static_cast<double>(v))); };
  if (f == ScoreFunc::kSigmoid) return 1.0f / (1.0f + exp_rn(-logit));
  DSV4_CHECK(f == ScoreFunc::kSqrtSoftplus, "moe_score: softmax is not elementwise");
  const float sp =
      logit > 20.0f ? logit : static_cast<float>(std::log1p(static_cast<double>(exp_rn(logit))));
  return std::sqrt(sp);
}

void moe_route(const MoeWeights& w, const MoeParams& p, const float* x, int32_t token,
               int32_t* experts, float* weights) {
  const int E = w.gate.out;
  std::vector<float> s(E);
  linear(w.gate, x, 1, s.data());  // fp32 x fp32
  switch (p.score_func) {
    case ScoreFunc::kSqrtSoftplus:
    case ScoreFunc::kSigmoid:
      for (float& v : s) v = moe_score(p.score_func, v);
      break;
    case ScoreFunc::kSoftmax: {
      float mx = *std::max_element(s.begin(), s.end()), sum = 0.0f;
      for (float& v : s) sum += (v = std::exp(v - mx));
      for (float& v : s) v /= sum;
      break;
    }
  }
  if (!w.tid2eid.empty()) {
    for (int i = 0; i < p.top_k; ++i) experts[i] = w.tid2eid[size_t(token) * p.top_k + i];
  } else {
    std::vector<float> biased(s);
    if (!w.bias.empty())
      for (int e = 0; e < E; ++e) biased[e] = s[e] + w.bias[e];
    std::vector<int32_t> idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + p.top_k, idx.end(), [&](int32_t a, int32_t b) {
      return biased[a] > biased[b] || (biased[a] == biased[b] && a < b);
    });
    std::copy(idx.begin(), idx.begin() + p.top_k, experts);
  }
  float sum = 0.0f;
  for (int i = 0; i < p.top_k; ++i) sum += (weights[i] = s[experts[i]]);
  for (int i = 0; i < p.top_k; ++i) {
    if (p.score_func != ScoreFunc::kSoftmax) weights[i] /= sum;
    weights[i] *= p.route_scale;
  }
}

void expert_forward(const ExpertWeights& e, float limit, const float* x, int m,
                    const float* weights, float* y) {
  const int inter = e.w1.out;
  std::vector<float> g(size_t(m) * inter), u(size_t(m) * inter);
  linear(e.w1, x, m, g.data());
  linear(e.w3, x, m, u.data());
  for (int r = 0; r < m; ++r)
    for (int i = 0; i < inter; ++i) {
      float gi = g[size_t(r) * inter + i], ui = u[size_t(r) * inter + i];
      if (limit > 0) {
        ui = std::clamp(ui, -limit, limit);
        gi = std::min(gi, limit);
      }
      float v = gi / (1.0f + std::exp(-gi)) * ui;
      if (weights) v = weights[r] * v;
      g[size_t(r) * inter + i] = round_bf16(v);
    }
  linear(e.w2, g.data(), m, y);
}

void moe_forward(const MoeWeights& w, const MoeParams& p, const float* x, const int32_t* tokens,
                 int n, int dim, float* y, int32_t* route_experts, float* route_weights) {
  const int K = p.top_k, E = w.n_experts();
  std::vector<int32_t> sel(size_t(n) * K);
  std::vector<float> wt(size_t(n) * K);
  for (int r = 0; r < n; ++r)
    moe_route(w, p, x + size_t(r) * dim, tokens ? tokens[r] : 0, sel.data() + size_t(r) * K,
              wt.data() + size_t(r) * K);
  if (route_experts) std::copy(sel.begin(), sel.end(), route_experts);
  if (route_weights) std::copy(wt.begin(), wt.end(), route_weights);
  // Each expert runs once over all rows routed to it. A row listing one expert twice (only
  // possible with hash routing) gets it once, as the reference's indexed update does.
  std::vector<std::vector<int>> rows_of(E), slot_of(E);
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < K; ++i) {
      const int32_t e = sel[size_t(r) * K + i];
      DSV4_CHECK(e >= 0 && e < E, "expert id ", e, " out of range");
      if (!rows_of[e].empty() && rows_of[e].back() == r) continue;
      rows_of[e].push_back(r);
      slot_of[e].push_back(i);
    }
  std::vector<float> out(size_t(n) * K * dim, 0.0f);  // [row, slot, dim]
  std::vector<char> used(size_t(n) * K, 0);
  std::vector<float> xe, we, ye;
  for (int e = 0; e < E; ++e) {
    const int m = static_cast<int>(rows_of[e].size());
    if (m == 0) continue;
    xe.resize(size_t(m) * dim);
    we.resize(m);
    ye.resize(size_t(m) * dim);
    for (int j = 0; j < m; ++j) {
      const int r = rows_of[e][j];
      std::copy_n(x + size_t(r) * dim, dim, xe.begin() + size_t(j) * dim);
      we[j] = wt[size_t(r) * K + slot_of[e][j]];
    }
    expert_forward(w.expert(e), p.swiglu_limit, xe.data(), m, we.data(), ye.data());
    for (int j = 0; j < m; ++j) {
      const size_t o = size_t(rows_of[e][j]) * K + slot_of[e][j];
      std::copy_n(ye.begin() + size_t(j) * dim, dim, out.begin() + o * dim);
      used[o] = 1;
    }
  }
  std::vector<float> shared(size_t(n) * dim);
  expert_forward(w.shared, p.swiglu_limit, x, n, nullptr, shared.data());
  moe_combine(sel.data(), K, out.data(), used.data(), shared.data(), n, dim, y);
}

void moe_combine(const int32_t* sel, int K, const float* out, const char* used, const float* shared,
                 int n, int dim, float* y) {
  // fp32 sum over the row's experts in ascending expert index (the reference's loop order),
  // then the shared expert, rounded to BF16.
  std::vector<float> acc(static_cast<size_t>(dim));
  std::vector<int> order(static_cast<size_t>(K));
  for (int r = 0; r < n; ++r) {
    std::iota(order.begin(), order.end(), 0);
    const int32_t* s = sel + size_t(r) * K;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return s[a] < s[b]; });
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int i : order) {
      const size_t o = size_t(r) * K + i;
      if (!used[o]) continue;
      for (int d = 0; d < dim; ++d) acc[size_t(d)] += out[o * dim + d];
    }
    float* yr = y + size_t(r) * dim;
    for (int d = 0; d < dim; ++d) yr[d] = round_bf16(acc[size_t(d)] + shared[size_t(r) * dim + d]);
  }
}

}  // namespace dsv4::cpu
