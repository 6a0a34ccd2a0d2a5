// Mixture of experts: sqrt-softplus router with bias-for-selection top-k or hash routing,
// SwiGLU experts (FP4) with the routing weight applied before w2, plus the shared expert.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/common/score_func.h"
#include "ops/cpu/linear.h"

namespace dsv4::cpu {

struct ExpertWeights {
  Linear w1, w2, w3;  // w1/w3 [inter, dim], w2 [dim, inter]
};

struct MoeWeights {
  Linear gate;                   // kF32 [experts, dim]
  std::vector<float> bias;       // [experts] (score routing) or empty
  std::vector<int32_t> tid2eid;  // [vocab, top-k] (hash routing) or empty
  // Routed expert e is experts[e], or experts[slot[e]] when slot is given: experts whose
  // checkpoint tensors are the same bytes (random weights with repeated experts) share one
  // dequantised copy, so a real-geometry model fits the host for the CPU reference.
  std::vector<ExpertWeights> experts;
  std::vector<int32_t> slot;
  ExpertWeights shared;  // FP8 linears

  int n_experts() const { return static_cast<int>(slot.empty() ? experts.size() : slot.size()); }
  const ExpertWeights& expert(int e) const {
    return experts[slot.empty() ? std::size_t(e) : std::size_t(slot[std::size_t(e)])];
  }
};

struct MoeParams {
  int top_k = 0;
  ScoreFunc score_func = ScoreFunc::kSqrtSoftplus;
  float route_scale = 1;
  float swiglu_limit = 0;  // 0 = no clamp
};

// The router score of one logit: sqrt(softplus(logit)) (softplus(l) = l for l > 20, else
// log1p(exp(l))) or sigmoid(logit) = 1 / (1 + exp(-logit)), in fp32 with every operation
// correctly rounded (exp and log1p evaluated in double, rounded once). Not for kSoftmax.
float moe_score(ScoreFunc f, float logit);

// Router for one token: selected experts and their weights (normalised, times route_scale),
// in selection order.
void moe_route(const MoeWeights& w, const MoeParams& p, const float* x, int32_t token,
               int32_t* experts, float* weights);

// One SwiGLU expert on `m` rows:
// y = w2(bf16(weight * silu(min(g, L)) * clamp(u, -L, L))), g = w1(x), u = w3(x).
// `weights` (one per row) may be null: no routing weight (the shared expert).
void expert_forward(const ExpertWeights& e, float swiglu_limit, const float* x, int m,
                    const float* weights, float* y);

// Full MoE for `n` rows: routed experts summed in fp32 in expert-index order, then the shared
// expert, rounded to BF16. Optional outputs of the routing ([n, top_k] each).
void moe_forward(const MoeWeights& w, const MoeParams& p, const float* x, const int32_t* tokens,
                 int n, int dim, float* y, int32_t* route_experts = nullptr,
                 float* route_weights = nullptr);

// The combine of moe_forward: per row, the routed experts' outputs `out` [n, K, dim] (slot i
// of row r at r * K + i, counted where `used`) summed in fp32 in ascending expert index, plus
// the shared expert's output [n, dim], rounded to BF16 into y [n, dim].
void moe_combine(const int32_t* sel, int K, const float* out, const char* used, const float* shared,
                 int n, int dim, float* y);

}  // namespace dsv4::cpu
