// How the parallel engine lays a model over W ranks. W = max(dp * tp, ep); dp * tp and ep
// both divide W. Attention runs as dp groups of tp ranks (tensor parallel inside a group: the
// query heads and output groups split by o_group, the indexer heads split; the shared KV latent
// and its caches whole on every rank of the group), replicated W / (dp * tp) times; the routed
// experts are split over ep ranks by contiguous ranges, replicated W / ep times.
//
// Rank w: tp index w % tp, then attention replica and dp group from w / tp
// (group = (w / tp) % dp, replica = w / (tp * dp)); expert range w % ep, EP group w / ep (the
// ep consecutive ranks that together hold every expert once).
//
// Placement of what is not split: the router (gate, bias, tid2eid) on every rank, so a token
// is routed where it lives; the embedding, the mHC units, the norms, the shared expert, wq_a,
// wkv, wo_b, the compressors and the head on every rank (wo_b runs on the gathered wo_a
// outputs whole, so its sums are the one-rank sums; the head runs on the dp group's rows).
#pragma once

#include <cstdint>
#include <string>

#include "model/model_config.h"

namespace dsv4 {

struct ParallelConfig {
  int dp = 1, ep = 1, tp = 1;
  int world() const;
  bool single() const { return world() == 1; }
};

class ParallelLayout {
 public:
  // Throws dsv4::Error naming what does not divide (the tuple, heads, o_groups, index heads,
  // experts).
  ParallelLayout(const ModelConfig& model, const ParallelConfig& p);

  const ParallelConfig& config() const { return p_; }
  int world() const { return world_; }
  int replicas() const { return world_ / (p_.dp * p_.tp); }

  int tp_rank(int w) const { return w % p_.tp; }
  int dp_group(int w) const { return (w / p_.tp) % p_.dp; }
  int replica(int w) const { return w / (p_.tp * p_.dp); }
  int ep_rank(int w) const { return w % p_.ep; }
  int ep_group(int w) const { return w / p_.ep; }
  // The rank of EP group `g` that holds expert e.
  int expert_owner(int g, int e) const { return g * p_.ep + e / experts_per_rank_; }

  // Ranges owned by rank w, [lo, hi).
  int heads_lo(int w) const { return tp_rank(w) * heads_per_rank_; }
  int heads_per_rank() const { return heads_per_rank_; }
  int groups_lo(int w) const { return tp_rank(w) * groups_per_rank_; }
  int groups_per_rank() const { return groups_per_rank_; }
  int index_heads_lo(int w) const { return tp_rank(w) * index_heads_per_rank_; }
  int index_heads_per_rank() const { return index_heads_per_rank_; }
  int experts_lo(int w) const { return ep_rank(w) * experts_per_rank_; }
  int experts_per_rank() const { return experts_per_rank_; }

  std::string describe() const;  // "dp 2 x tp 2 attention, ep 2 experts over 4 ranks"

 private:
  ParallelConfig p_;
  int world_ = 1;
  int heads_per_rank_ = 0, groups_per_rank_ = 0, index_heads_per_rank_ = 0;
  int experts_per_rank_ = 0;
};

}  // namespace dsv4
