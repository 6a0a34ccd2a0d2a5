#include "ops/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/formats.h"

namespace dsv4::cpu {
namespace {

float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

}  // namespace

void moe_route(const MoeWeights& w, const MoeParams& p, const float* x, int32_t token,
               int32_t* experts, float* weights) {
  const int E = w.gate.out;
  std::vector<float> s(E);
  linear(w.gate, x, 1, s.data());  // fp32 x fp32
  switch (p.score_func) {
    case ScoreFunc::kSqrtSoftplus:
      for (float& v : s) v = std::sqrt(softplus(v));
      break;
    case ScoreFunc::kSigmoid:
      for (float& v : s) v = 1.0f / (1.0f + std::exp(-v));
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

void expert_forward(const ExpertWeights& e, float limit, const float* x, float weight, float* y) {
  const int inter = e.w1.out;
  std::vector<float> g(inter), u(inter), a(inter);
  linear(e.w1, x, 1, g.data());
  linear(e.w3, x, 1, u.data());
  for (int i = 0; i < inter; ++i) {
    float gi = g[i], ui = u[i];
    if (limit > 0) {
      ui = std::clamp(ui, -limit, limit);
      gi = std::min(gi, limit);
    }
    float v = gi / (1.0f + std::exp(-gi)) * ui;
    if (weight >= 0) v = weight * v;
    a[i] = round_bf16(v);
  }
  linear(e.w2, a.data(), 1, y);
}

void moe_forward(const MoeWeights& w, const MoeParams& p, const float* x, const int32_t* tokens,
                 int n, int dim, float* y, int32_t* route_experts, float* route_weights) {
  std::vector<int32_t> sel(p.top_k);
  std::vector<float> wt(p.top_k), acc(dim), out(dim);
  for (int r = 0; r < n; ++r) {
    const float* xr = x + size_t(r) * dim;
    moe_route(w, p, xr, tokens ? tokens[r] : 0, sel.data(), wt.data());
    if (route_experts) std::copy(sel.begin(), sel.end(), route_experts + size_t(r) * p.top_k);
    if (route_weights) std::copy(wt.begin(), wt.end(), route_weights + size_t(r) * p.top_k);
    // The reference loops over experts in index order; a token listed twice under one
    // expert (possible only with hash routing) is added once.
    std::vector<int> order(p.top_k);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return sel[a] < sel[b]; });
    std::fill(acc.begin(), acc.end(), 0.0f);
    int32_t prev = -1;
    for (int i : order) {
      const int32_t e = sel[i];
      DSV4_CHECK(e >= 0 && e < static_cast<int32_t>(w.experts.size()), "expert id ", e,
                 " out of range");
      if (e == prev) continue;
      prev = e;
      expert_forward(w.experts[e], p.swiglu_limit, xr, wt[i], out.data());
      for (int d = 0; d < dim; ++d) acc[d] += out[d];
    }
    expert_forward(w.shared, p.swiglu_limit, xr, -1.0f, out.data());
    float* yr = y + size_t(r) * dim;
    for (int d = 0; d < dim; ++d) yr[d] = round_bf16(acc[d] + out[d]);
  }
}

}  // namespace dsv4::cpu
