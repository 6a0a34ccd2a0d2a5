#include "backends/cpu/parallel_moe.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "core/error.h"

namespace dsv4 {
namespace {

// Appends / reads plain values to / from a byte buffer.
template <typename T>
void put(std::vector<uint8_t>& b, const T* v, size_t n) {
  const size_t o = b.size();
  b.resize(o + n * sizeof(T));
  if (n) std::memcpy(b.data() + o, v, n * sizeof(T));
}
template <typename T>
void take(const std::vector<uint8_t>& b, size_t& off, T* v, size_t n) {
  DSV4_CHECK(off + n * sizeof(T) <= b.size(), "parallel MoE: truncated exchange");
  if (n) std::memcpy(v, b.data() + off, n * sizeof(T));
  off += n * sizeof(T);
}

}  // namespace

void moe_forward_parallel(const cpu::MoeWeights& w, const cpu::MoeParams& p, const float* x,
                          const int32_t* tokens, int n, int dim, float* y, const RankContext& rk,
                          int32_t* route_experts, float* route_weights) {
  DSV4_CHECK(rk.layout && rk.group && rk.ep, "parallel MoE without its communicators");
  const ParallelLayout& L = *rk.layout;
  Communicator& group = *rk.group;
  Communicator& ep = *rk.ep;
  const int K = p.top_k, E = w.n_experts();
  // 1. Route every row (the group's ranks all hold them).
  std::vector<int32_t> sel(size_t(n) * K);
  std::vector<float> wt(size_t(n) * K);
  for (int r = 0; r < n; ++r)
    cpu::moe_route(w, p, x + size_t(r) * dim, tokens ? tokens[r] : 0, sel.data() + size_t(r) * K,
                   wt.data() + size_t(r) * K);
  if (route_experts) std::copy(sel.begin(), sel.end(), route_experts);
  if (route_weights) std::copy(wt.begin(), wt.end(), route_weights);

  // 2. This rank's share of the rows.
  const int gs = group.size(), gm = group.rank();
  auto share = [&](int m) {
    return std::pair<int, int>{int(int64_t(n) * m / gs), int(int64_t(n) * (m + 1) / gs)};
  };
  const auto [lo, hi] = share(gm);
  const int mine = hi - lo;

  // 3. Dispatch (row, slot) pairs to the experts' owners: [count][expert, key, weight, x]...
  // A row listing one expert twice (hash routing) sends it once, as moe_forward runs it once.
  const int eg = L.ep_group(rk.rank);
  std::vector<std::vector<uint8_t>> send(size_t(ep.size())), recv;
  std::vector<std::vector<int32_t>> sent_keys(size_t(ep.size()));  // per owner, in order
  for (int r = lo; r < hi; ++r)
    for (int i = 0; i < K; ++i) {
      const int32_t e = sel[size_t(r) * K + i];
      DSV4_CHECK(e >= 0 && e < E, "expert id ", e, " out of range");
      bool seen = false;
      for (int j = 0; j < i; ++j) seen |= sel[size_t(r) * K + j] == e;
      if (seen) continue;
      const int owner = L.expert_owner(eg, e) - eg * L.config().ep;
      const int32_t key = (r - lo) * K + i;
      std::vector<uint8_t>& b = send[size_t(owner)];
      put(b, &e, 1);
      put(b, &key, 1);
      put(b, &wt[size_t(r) * K + i], 1);
      put(b, x + size_t(r) * dim, size_t(dim));
      sent_keys[size_t(owner)].push_back(key);
    }
  ep.all_to_all(send, recv);

  // 4. Run the owned experts over what arrived, one batch per expert, and send each source its
  // outputs in the order it sent the rows.
  const size_t item = 3 * 4 + size_t(dim) * 4;
  struct Item {
    int src;
    size_t index;  // in the source's buffer
    float weight;
    const float* x;
  };
  std::map<int32_t, std::vector<Item>> by_expert;
  std::vector<std::vector<float>> results(recv.size());
  for (size_t s = 0; s < recv.size(); ++s) {
    DSV4_CHECK(recv[s].size() % item == 0, "parallel MoE: malformed exchange");
    const size_t count = recv[s].size() / item;
    results[s].resize(count * size_t(dim));
    for (size_t k = 0; k < count; ++k) {
      size_t off = k * item;
      int32_t e, key;
      float weight;
      take(recv[s], off, &e, 1);
      take(recv[s], off, &key, 1);
      take(recv[s], off, &weight, 1);
      DSV4_CHECK(e >= L.experts_lo(rk.rank) && e < L.experts_lo(rk.rank) + L.experts_per_rank(),
                 "parallel MoE: expert ", e, " sent to a rank that does not hold it");
      by_expert[e].push_back(
          {int(s), k, weight, reinterpret_cast<const float*>(recv[s].data() + off)});
    }
  }
  std::vector<float> xe, we, ye;
  for (const auto& [e, items] : by_expert) {
    const int m = int(items.size());
    xe.resize(size_t(m) * dim);
    we.resize(size_t(m));
    ye.resize(size_t(m) * dim);
    for (int j = 0; j < m; ++j) {
      std::memcpy(xe.data() + size_t(j) * dim, items[size_t(j)].x, size_t(dim) * 4);
      we[size_t(j)] = items[size_t(j)].weight;
    }
    cpu::expert_forward(w.expert(e), p.swiglu_limit, xe.data(), m, we.data(), ye.data());
    for (int j = 0; j < m; ++j)
      std::copy_n(ye.data() + size_t(j) * dim, dim,
                  results[size_t(items[size_t(j)].src)].data() + items[size_t(j)].index * dim);
  }
  std::vector<std::vector<uint8_t>> back(results.size()), got;
  for (size_t s = 0; s < results.size(); ++s) put(back[s], results[s].data(), results[s].size());
  ep.all_to_all(back, got);

  // 5. Combine this rank's rows as moe_forward does.
  std::vector<float> out(size_t(mine) * K * dim, 0.0f);
  std::vector<char> used(size_t(mine) * K, 0);
  for (size_t o = 0; o < got.size(); ++o) {
    DSV4_CHECK(got[o].size() == sent_keys[o].size() * size_t(dim) * 4,
               "parallel MoE: an owner returned ", got[o].size(), " bytes for ",
               sent_keys[o].size(), " rows");
    for (size_t k = 0; k < sent_keys[o].size(); ++k) {
      const int32_t key = sent_keys[o][k];
      std::memcpy(out.data() + size_t(key) * dim, got[o].data() + k * size_t(dim) * 4,
                  size_t(dim) * 4);
      used[size_t(key)] = 1;
    }
  }
  std::vector<float> shared(size_t(mine) * dim), ym(size_t(mine) * dim);
  cpu::expert_forward(w.shared, p.swiglu_limit, x + size_t(lo) * dim, mine, nullptr, shared.data());
  cpu::moe_combine(sel.data() + size_t(lo) * K, K, out.data(), used.data(), shared.data(), mine,
                   dim, ym.data());

  // 6. The group's ranks exchange their rows.
  std::vector<std::vector<uint8_t>> mine_out(static_cast<size_t>(gs)), rows;
  for (int m = 0; m < gs; ++m) put(mine_out[size_t(m)], ym.data(), ym.size());
  group.all_to_all(mine_out, rows);
  for (int m = 0; m < gs; ++m) {
    const auto [a, b] = share(m);
    DSV4_CHECK(rows[size_t(m)].size() == size_t(b - a) * dim * 4, "parallel MoE: row exchange");
    if (!rows[size_t(m)].empty())  // an idle rank's share is empty (and its data() null)
      std::memcpy(y + size_t(a) * dim, rows[size_t(m)].data(), rows[size_t(m)].size());
  }
}

}  // namespace dsv4
