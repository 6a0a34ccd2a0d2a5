// The parallel MoE's decode-exchange kernels (backends/cuda/moe_exchange.h) against host
// references, bit for bit, on random inputs with poisoned outputs:
//  - pack + select: every rank's routed rows packed into its slab (counts below the capacity,
//    zero, and full), the slabs back to back, and an owner's selection: its distinct experts in
//    slot order (hash rows with repeated experts), at most min(top-k, its experts) per row, -1
//    and weight 0 elsewhere and on every row past a slab's count, the x rows of valid rows;
//  - partial sums: each row's pairs summed in fp32 in ascending expert index (stable), rows
//    without pairs 0;
//  - finish: the owners' partial sums added in owner order, then the shared expert (and none),
//    rounded to BF16 once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backends/cuda/moe_exchange.h"
#include "core/formats.h"
#include "cuda/cuda_support.h"
#include "cuda/gpu_test.h"

namespace dsv4::test {
namespace {

class MoeExchange : public GpuTest {};

struct Routed {
  std::vector<int32_t> sel;
  std::vector<float> wt;
  std::vector<uint16_t> xq;  // BF16 bits
};

TEST_F(MoeExchange, PackAndSelectKeepTheOwnersDistinctExperts) {
  std::mt19937 rng(17);
  const int dim = 64, K = 4, cap = 5, P = 3, E = 12;
  for (int El : {4, 2}) {  // out_k = top-k, and out_k = experts per owner < top-k
    SCOPED_TRACE(El);
    const int me = 1, lo = me * El, out_k = std::min(K, El);
    const int counts[P] = {3, 0, cap};
    const size_t slab = exchange::slab_bytes(cap, K, dim);
    cuda::DeviceBuffer<uint8_t> slabs(slab * P);
    slabs.fill_bytes(0x5a);  // poison: rows past a count are never read
    std::vector<Routed> ranks(P);
    for (int s = 0; s < P; ++s) {
      Routed& r = ranks[size_t(s)];
      const int m = counts[s];
      for (int i = 0; i < m * K; ++i) {
        // Experts near the owner's range, repeats allowed (hash rows).
        r.sel.push_back(int32_t(rng() % uint32_t(E)));
        r.wt.push_back(float(rng() % 1000) / 997.0f);
      }
      if (m > 0) r.sel[1] = r.sel[0];  // a repeated expert
      for (int i = 0; i < m * dim; ++i) r.xq.push_back(uint16_t(rng()));
      cuda::DeviceBuffer<int32_t> dsel(r.sel.empty() ? std::vector<int32_t>{0} : r.sel);
      cuda::DeviceBuffer<float> dwt(r.wt.empty() ? std::vector<float>{0} : r.wt);
      cuda::DeviceBuffer<uint16_t> dxq(r.xq.empty() ? std::vector<uint16_t>(8, 0) : r.xq);
      exchange::pack(dsel.data(), dwt.data(), bf16_ptr(dxq), m, K, dim, cap,
                     slabs.data() + size_t(s) * slab, nullptr);
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    }
    const int rows = P * cap;
    cuda::DeviceBuffer<int32_t> sel(size_t(rows) * out_k);
    cuda::DeviceBuffer<float> wt(size_t(rows) * out_k);
    cuda::DeviceBuffer<uint16_t> xq(size_t(rows) * dim);
    sel.fill_bytes(0x7f);
    wt.fill_bytes(0x7f);
    xq.fill_bytes(0x7f);
    exchange::select(slabs.data(), P, cap, K, dim, lo, El, out_k, sel.data(), wt.data(),
                     bf16_ptr(xq), nullptr);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<int32_t> got_sel = sel.download();
    const std::vector<float> got_wt = wt.download();
    const std::vector<uint16_t> got_xq = xq.download();
    int bad = 0, pairs = 0;
    for (int s = 0; s < P; ++s)
      for (int i = 0; i < cap; ++i) {
        const int r = s * cap + i;
        std::vector<int32_t> want_sel;
        std::vector<float> want_wt;
        if (i < counts[s])
          for (int k = 0; k < K && int(want_sel.size()) < out_k; ++k) {
            const int e = ranks[size_t(s)].sel[size_t(i) * K + k];
            if (e < lo || e >= lo + El) continue;
            bool seen = false;
            for (int32_t f : want_sel) seen = seen || f == e - lo;
            if (seen) continue;
            want_sel.push_back(e - lo);
            want_wt.push_back(ranks[size_t(s)].wt[size_t(i) * K + k]);
          }
        pairs += int(want_sel.size());
        while (int(want_sel.size()) < out_k) want_sel.push_back(-1), want_wt.push_back(0.0f);
        for (int k = 0; k < out_k; ++k) {
          bad += got_sel[size_t(r) * out_k + k] != want_sel[size_t(k)];
          bad += std::memcmp(&got_wt[size_t(r) * out_k + k], &want_wt[size_t(k)], 4) != 0;
        }
        if (i < counts[s])
          bad += std::memcmp(&got_xq[size_t(r) * dim], &ranks[size_t(s)].xq[size_t(i) * dim],
                             size_t(dim) * 2) != 0;
      }
    EXPECT_EQ(bad, 0);
    EXPECT_GT(pairs, 0) << "the test routed nothing to the owner";
  }
}

TEST_F(MoeExchange, PartialSumsAddEachRowsPairsInExpertOrder) {
  std::mt19937 rng(23);
  const int dim = 128, K = 3, rows = 9, npairs = 20;
  std::vector<int32_t> sel(size_t(rows) * K), pos(size_t(rows) * K);
  std::vector<float> ye(size_t(npairs) * dim);
  for (float& v : ye) v = round_bf16(std::ldexp(float(int(rng() % 2001) - 1000), -6));
  int next = 0;
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < K; ++k) {
      const bool none = r == 4 || (rng() % 4 == 0);  // row 4: no pairs at all
      sel[size_t(r) * K + k] = none ? -1 : int32_t(rng() % 5);
      pos[size_t(r) * K + k] = none ? -1 : (next++ % npairs);
    }
  cuda::DeviceBuffer<int32_t> dsel(sel), dpos(pos);
  cuda::DeviceBuffer<uint16_t> dye = to_device_bf16(ye);
  cuda::DeviceBuffer<float> out(size_t(rows) * dim);
  out.fill_bytes(0x7f);
  exchange::partial_sums(dsel.data(), dpos.data(), rows, K, bf16_ptr(dye), dim, out.data(),
                         nullptr);
  const std::vector<float> got = out.download();
  int bad = 0;
  for (int r = 0; r < rows; ++r) {
    // Slots in ascending expert index, ties in slot order.
    std::vector<int> order;
    for (int k = 0; k < K; ++k) order.push_back(k);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return sel[size_t(r) * K + a] < sel[size_t(r) * K + b]; });
    for (int c = 0; c < dim; ++c) {
      float acc = 0.0f;
      for (int k : order) {
        const int p = pos[size_t(r) * K + k];
        if (p >= 0) acc += ye[size_t(p) * dim + c];
      }
      bad += std::memcmp(&acc, &got[size_t(r) * dim + c], 4) != 0;
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST_F(MoeExchange, FinishAddsOwnersInOrderThenTheSharedExpert) {
  std::mt19937 rng(29);
  const int dim = 96, owners = 3, cap = 4, m = 3;
  std::vector<float> parts(size_t(owners) * cap * dim);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  for (float& v : parts) v = u(rng) * (rng() % 3 == 0 ? 1e-4f : 1.0f);
  std::vector<float> shared(size_t(m) * dim);
  for (float& v : shared) v = round_bf16(u(rng));
  cuda::DeviceBuffer<float> dparts(parts);
  cuda::DeviceBuffer<uint16_t> dshared = to_device_bf16(shared);
  for (bool with_shared : {true, false}) {
    SCOPED_TRACE(with_shared);
    cuda::DeviceBuffer<uint16_t> y(size_t(cap) * dim);
    y.fill_bytes(0x7f);
    exchange::finish(dparts.data(), owners, cap, m, with_shared ? bf16_ptr(dshared) : nullptr, dim,
                     bf16_ptr(y), nullptr);
    const std::vector<uint16_t> got = y.download();
    int bad = 0;
    for (int i = 0; i < m; ++i)
      for (int c = 0; c < dim; ++c) {
        float acc = 0.0f;
        for (int o = 0; o < owners; ++o) acc += parts[(size_t(o) * cap + i) * dim + c];
        acc += with_shared ? shared[size_t(i) * dim + c] : 0.0f;
        bad += got[size_t(i) * dim + c] != float_to_bf16(acc);
      }
    for (int i = m; i < cap; ++i)  // rows past m untouched
      for (int c = 0; c < dim; ++c) bad += got[size_t(i) * dim + c] != 0x7f7f;
    EXPECT_EQ(bad, 0);
  }
}

}  // namespace
}  // namespace dsv4::test
