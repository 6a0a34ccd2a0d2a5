// The NCCL communicator: all-gather, all-to-all(v) and all-reduce on device buffers, one rank
// per visible GPU as threads of this process (one GPU: a world of one, which the parallel
// engine's one-rank NCCL path uses), and captured in a CUDA graph.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <memory>
#include <thread>
#include <vector>

#include "comm/nccl_communicator.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/device.h"
#include "ops/cuda/common/device_buffer.h"

namespace dsv4::test {
namespace {

TEST(Nccl, CollectivesAcrossTheVisibleGpus) {
  const int n = cuda::device_count();
  if (n == 0) GTEST_SKIP() << "no GPU: " << cuda::describe_device();
  const std::vector<uint8_t> id = NcclCommunicator::unique_id();
  std::vector<std::thread> threads;
  std::vector<int> failures(size_t(n), 0);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      DSV4_CUDA_CHECK(cudaSetDevice(r));
      NcclCommunicator c(id, n, r, r);
      cudaStream_t s;
      DSV4_CUDA_CHECK(cudaStreamCreate(&s));
      // all-gather: rank r contributes {r, r, r, r}.
      cuda::DeviceBuffer<float> mine(std::vector<float>(4, float(r)));
      cuda::DeviceBuffer<float> all(size_t(4 * n));
      c.all_gather(mine.data(), all.data(), 16, s);
      // all-to-all(v): rank r sends r + d + 1 floats of value 100 r + d to rank d.
      std::vector<size_t> so, sb, ro, rb;
      std::vector<float> send;
      for (int d = 0; d < n; ++d) {
        so.push_back(send.size() * 4);
        sb.push_back(size_t(r + d + 1) * 4);
        send.insert(send.end(), size_t(r + d + 1), float(100 * r + d));
      }
      size_t total = 0;
      for (int src = 0; src < n; ++src) {
        ro.push_back(total * 4);
        rb.push_back(size_t(src + r + 1) * 4);
        total += size_t(src + r + 1);
      }
      cuda::DeviceBuffer<float> dsend(send), drecv(total);
      c.all_to_all_v(dsend.data(), so, sb, drecv.data(), ro, rb, s);
      // all-reduce, captured in a graph and replayed twice.
      cuda::DeviceBuffer<float> acc(std::vector<float>(8, 1.0f));
      cudaGraph_t g;
      cudaGraphExec_t ge;
      DSV4_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      c.all_reduce_sum_f32(acc.data(), 8, s);
      DSV4_CUDA_CHECK(cudaStreamEndCapture(s, &g));
      DSV4_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
      DSV4_CUDA_CHECK(cudaGraphLaunch(ge, s));
      DSV4_CUDA_CHECK(cudaGraphLaunch(ge, s));
      DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
      int bad = 0;
      const std::vector<float> a = all.download();
      for (int k = 0; k < 4 * n; ++k) bad += a[size_t(k)] != float(k / 4);
      const std::vector<float> got = drecv.download();
      size_t at = 0;
      for (int src = 0; src < n; ++src)
        for (int k = 0; k < src + r + 1; ++k) bad += got[at++] != float(100 * src + r);
      for (float v : acc.download()) bad += v != float(n * n);  // 1 -> n -> n^2
      failures[size_t(r)] = bad;
      cudaGraphExecDestroy(ge);
      cudaGraphDestroy(g);
      cudaStreamDestroy(s);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(failures[size_t(r)], 0) << "rank " << r;
}

// The parallel engine's view (DeviceCommunicator): ncclCommSplit into the ranks of one parity,
// ordered by descending key, and an all-gather inside each part.
TEST(Nccl, SplitThroughTheDeviceCommunicatorInterface) {
  const int n = cuda::device_count();
  if (n == 0) GTEST_SKIP() << "no GPU: " << cuda::describe_device();
  const std::vector<uint8_t> id = NcclCommunicator::unique_id();
  std::vector<std::thread> threads;
  std::vector<int> failures(size_t(n), 0);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      DSV4_CUDA_CHECK(cudaSetDevice(r));
      NcclCommunicator world(id, n, r, r);
      DeviceCommunicator& c = world;
      std::unique_ptr<DeviceCommunicator> part = c.split(r % 2, -r);
      cudaStream_t s;
      DSV4_CUDA_CHECK(cudaStreamCreate(&s));
      cuda::DeviceBuffer<int> mine(std::vector<int>{r}), all(size_t(part->size()));
      part->all_gather(mine.data(), all.data(), 4, s);
      DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
      std::vector<int> want;  // my parity, descending
      for (int q = n - 1; q >= 0; --q)
        if (q % 2 == r % 2) want.push_back(q);
      failures[size_t(r)] = (all.download() != want) + (part->size() != int(want.size()));
      part.reset();
      cudaStreamDestroy(s);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(failures[size_t(r)], 0) << "rank " << r;
}

}  // namespace
}  // namespace dsv4::test
