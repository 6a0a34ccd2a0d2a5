#include "model/parallel_layout.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4 {

int ParallelConfig::world() const {
  return std::max(dp * tp, ep);
}

ParallelLayout::ParallelLayout(const ModelConfig& m, const ParallelConfig& p) : p_(p) {
  DSV4_CHECK(p.dp >= 1 && p.ep >= 1 && p.tp >= 1, "--dp, --ep and --tp must be >= 1 (got dp ", p.dp,
             ", ep ", p.ep, ", tp ", p.tp, ")");
  world_ = p.world();
  DSV4_CHECK(world_ % (p.dp * p.tp) == 0 && world_ % p.ep == 0, "dp x tp = ", p.dp * p.tp,
             " and ep = ", p.ep, " must both divide the world size ", world_,
             " (= the larger of them)");
  DSV4_CHECK(m.n_heads % p.tp == 0, "--tp ", p.tp, " does not divide the ", m.n_heads,
             " attention heads");
  DSV4_CHECK(m.o_groups % p.tp == 0, "--tp ", p.tp, " does not divide the ", m.o_groups,
             " output groups (o_groups)");
  DSV4_CHECK(m.index_n_heads == 0 || m.index_n_heads % p.tp == 0, "--tp ", p.tp,
             " does not divide the ", m.index_n_heads, " indexer heads");
  DSV4_CHECK(m.n_routed_experts % p.ep == 0, "--ep ", p.ep, " does not divide the ",
             m.n_routed_experts, " routed experts");
  heads_per_rank_ = m.n_heads / p.tp;
  groups_per_rank_ = m.o_groups / p.tp;
  index_heads_per_rank_ = m.index_n_heads / p.tp;
  experts_per_rank_ = m.n_routed_experts / p.ep;
}

std::string ParallelLayout::describe() const {
  return cat("dp ", p_.dp, " x tp ", p_.tp, " attention",
             replicas() > 1 ? cat(" (x", replicas(), " replicas)") : std::string(), ", ep ", p_.ep,
             " experts over ", world_, " rank(s)");
}

}  // namespace dsv4
