// The NCCL communicator: all-gather, all-to-all(v) and all-reduce on device buffers, one rank
// per visible GPU as threads of this process (one GPU: a world of one, which the parallel
// engine's one-rank NCCL path uses), and captured in a CUDA graph (on the non-blocking world;
// the split, blocking, communicators are captured by parallel_cuda_test's decode graphs).
// Set-up never hangs (NcclSetup): a world that one rank never joins fails within its deadline,
// a cancelled set-up ends at once as a consequence (CollectiveAborted), and NCCL's own set-up
// error (two ranks on one GPU) ends both ranks with NCCL's message; afterwards a new world still
// works. Each of those runs under a watchdog that fails the test (and ends the process) on a
// hang.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/collective_aborted.h"
#include "comm/nccl_communicator.h"
#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/device.h"
#include "ops/cuda/common/device_buffer.h"
#include "support/rank_threads.h"

namespace dsv4::test {
namespace {

TEST(Nccl, CollectivesAcrossTheVisibleGpus) {
  const int n = cuda::device_count();
  if (n == 0) GTEST_SKIP() << "no GPU: " << cuda::describe_device();
  const std::vector<uint8_t> id = NcclCommunicator::unique_id();
  std::vector<int> failures(size_t(n), 0);
  on_each_rank(n, [&](int r) {
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
  for (int r = 0; r < n; ++r) EXPECT_EQ(failures[size_t(r)], 0) << "rank " << r;
}

// The parallel engine's view (DeviceCommunicator): ncclCommSplit into the ranks of one parity,
// ordered by descending key, and an all-gather inside each part.
TEST(Nccl, SplitThroughTheDeviceCommunicatorInterface) {
  const int n = cuda::device_count();
  if (n == 0) GTEST_SKIP() << "no GPU: " << cuda::describe_device();
  const std::vector<uint8_t> id = NcclCommunicator::unique_id();
  std::vector<int> failures(size_t(n), 0);
  on_each_rank(n, [&](int r) {
    DSV4_CUDA_CHECK(cudaSetDevice(r));
    NcclCommunicator world(id, n, r, r);
    DeviceCommunicator& c = world;
    std::unique_ptr<DeviceCommunicator> part = c.split(r % 2, -r);
    // The world is set up non-blocking, its splits are blocking (nccl_communicator.h).
    const auto* nccl_part = dynamic_cast<const NcclCommunicator*>(part.get());
    failures[size_t(r)] += !world.nonblocking() + (!nccl_part || nccl_part->nonblocking());
    cudaStream_t s;
    DSV4_CUDA_CHECK(cudaStreamCreate(&s));
    cuda::DeviceBuffer<int> mine(std::vector<int>{r}), all(size_t(part->size()));
    part->all_gather(mine.data(), all.data(), 4, s);
    DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<int> want;  // my parity, descending
    for (int q = n - 1; q >= 0; --q)
      if (q % 2 == r % 2) want.push_back(q);
    failures[size_t(r)] += (all.download() != want) + (part->size() != int(want.size()));
    part.reset();
    cudaStreamDestroy(s);
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(failures[size_t(r)], 0) << "rank " << r;
}

// The engine's start (ParallelCudaRunner): three splits of the non-blocking world in a row,
// repeated on a few worlds. A split of a non-blocking parent is finished by NCCL's own thread
// after ncclCommSplit returned ncclSuccess: each must come back made (never "no communicator
// made"), of the right size, and work (an all-gather of the ranks' ids, in key order).
TEST(Nccl, EverySplitOfTheNonBlockingWorldIsMadeBeforeItReturns) {
  const int n = cuda::device_count();
  if (n == 0) GTEST_SKIP() << "no GPU: " << cuda::describe_device();
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(round);
    const std::vector<uint8_t> id = NcclCommunicator::unique_id();
    std::vector<int> failures(size_t(n), 0);
    on_each_rank(n, [&](int r) {
      DSV4_CUDA_CHECK(cudaSetDevice(r));
      NcclCommunicator world(id, n, r, r);
      cudaStream_t s;
      DSV4_CUDA_CHECK(cudaStreamCreate(&s));
      // Everyone together, keyed by rank; then by parity; then everyone, keyed backwards.
      const int colors[3] = {0, r % 2, 7};
      const int keys[3] = {r, r, -r};
      std::vector<std::unique_ptr<DeviceCommunicator>> parts;
      for (int k = 0; k < 3; ++k) parts.push_back(world.split(colors[k], keys[k]));
      for (int k = 0; k < 3; ++k) {
        DeviceCommunicator& p = *parts[size_t(k)];
        std::vector<int> want;
        for (int q = 0; q < n; ++q)
          if (colors[k] == (k == 1 ? q % 2 : colors[k])) want.push_back(q);
        if (k == 2) std::reverse(want.begin(), want.end());
        cuda::DeviceBuffer<int> mine(std::vector<int>{r}), all(size_t(p.size()));
        p.all_gather(mine.data(), all.data(), 4, s);
        DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
        failures[size_t(r)] += (p.size() != int(want.size())) + (all.download() != want);
      }
      parts.clear();
      cudaStreamDestroy(s);
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(failures[size_t(r)], 0) << "rank " << r;
  }
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Runs `body` on a thread of its own; one still running after `limit_s` is a hang: the test
// fails and the process ends (a hung thread cannot be joined).
void within(double limit_s, const char* what, const std::function<void()>& body) {
  std::promise<void> done;
  std::future<void> finished = done.get_future();
  std::thread t([&] {
    try {
      body();
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": " << e.what();
    } catch (...) {
      ADD_FAILURE() << what << ": a non-standard exception";
    }
    done.set_value();
  });
  if (finished.wait_for(std::chrono::duration<double>(limit_s)) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: %s still running after %g s (a hang)\n", what, limit_s);
    std::fflush(stderr);
    std::_Exit(1);
  }
  t.join();
}

// How one rank's set-up ended.
struct SetupEnd {
  enum Kind { kNone, kMade, kAborted, kError } kind = kNone;
  std::string what;
  double seconds = 0;
};

SetupEnd set_up(const std::vector<uint8_t>& id, int world, int rank, int device,
                const NcclSetup& setup) {
  SetupEnd e;
  const Clock::time_point t0 = Clock::now();
  try {
    NcclCommunicator c(id, world, rank, device, setup);
    e.kind = SetupEnd::kMade;
  } catch (const CollectiveAborted& x) {
    e.kind = SetupEnd::kAborted;
    e.what = x.what();
  } catch (const std::exception& x) {
    e.kind = SetupEnd::kError;
    e.what = x.what();
  }
  e.seconds = seconds_since(t0);
  return e;
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A world of two that rank 1 never joins: rank 0's set-up (blocking NCCL would wait forever)
// fails when its deadline passes, not before, and soon after (the abort ends NCCL's bootstrap),
// as an Error that says so and names the rank.
TEST(Nccl, ASetUpThatARankNeverJoinsFailsAtItsDeadline) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU: " << cuda::describe_device();
  const std::vector<uint8_t> id = NcclCommunicator::unique_id();
  NcclSetup setup;
  setup.timeout_s = 3;
  SetupEnd e;
  within(60, "a set-up nobody else joins", [&] { e = set_up(id, 2, 0, 0, setup); });
  std::printf("  rank 0 of 2 alone: %.2f s: %s\n", e.seconds, e.what.c_str());
  ASSERT_EQ(e.kind, SetupEnd::kError) << e.what;
  EXPECT_TRUE(has(e.what, "did not complete within 3 s")) << e.what;
  EXPECT_TRUE(has(e.what, "rank 0 of 2")) << e.what;
  EXPECT_GE(e.seconds, 3.0);
  // The abort joins NCCL's set-up thread, which sees the abort flag in its next socket poll.
  EXPECT_LT(e.seconds, 3.0 + 20.0);
}

// The control plane's signal (another rank or node failed): a set-up in flight ends within
// moments of it, long before its deadline, as a consequence (CollectiveAborted: the cause is
// reported by whoever failed).
TEST(Nccl, ACancelledSetUpEndsAsAConsequence) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU: " << cuda::describe_device();
  const std::vector<uint8_t> id = NcclCommunicator::unique_id();
  std::atomic<bool> failed{false};
  NcclSetup setup;
  setup.timeout_s = 600;
  setup.cancelled = [&] { return failed.load(); };
  SetupEnd e;
  within(60, "a cancelled set-up", [&] {
    std::thread signal([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      failed = true;
    });
    e = set_up(id, 2, 0, 0, setup);
    signal.join();
  });
  std::printf("  cancelled after 0.5 s: ended after %.2f s: %s\n", e.seconds, e.what.c_str());
  ASSERT_EQ(e.kind, SetupEnd::kAborted) << e.what;
  EXPECT_TRUE(has(e.what, "cancelled")) << e.what;
  EXPECT_TRUE(has(e.what, "rank 0 of 2")) << e.what;
  EXPECT_GE(e.seconds, 0.5);
  EXPECT_LT(e.seconds, 0.5 + 20.0);
}

// NCCL's own set-up error, found on NCCL's thread (two ranks on one GPU: ncclInvalidUsage unless
// NCCL_MULTI_RANK_GPU_ENABLE=1): both ranks end with it, well before the deadline.
TEST(Nccl, AnNcclSetUpErrorEndsEveryRankWithNcclsMessage) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU: " << cuda::describe_device();
  const char* multi = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  if (multi && std::string(multi) != "0")
    GTEST_SKIP() << "NCCL_MULTI_RANK_GPU_ENABLE=" << multi << " lets two ranks share a GPU";
  const std::vector<uint8_t> id = NcclCommunicator::unique_id();
  NcclSetup setup;
  setup.timeout_s = 120;
  SetupEnd e[2];
  within(150, "two ranks on one GPU", [&] {
    std::thread other([&] { e[1] = set_up(id, 2, 1, 0, setup); });
    e[0] = set_up(id, 2, 0, 0, setup);
    other.join();
  });
  for (int r = 0; r < 2; ++r) {
    std::printf("  rank %d of 2 on GPU 0: %.2f s: %s\n", r, e[r].seconds, e[r].what.c_str());
    EXPECT_EQ(e[r].kind, SetupEnd::kError) << "rank " << r << ": " << e[r].what;
    EXPECT_TRUE(has(e[r].what, "invalid usage")) << e[r].what;
    EXPECT_TRUE(has(e[r].what, "rank " + std::to_string(r) + " of 2")) << e[r].what;
    EXPECT_LT(e[r].seconds, 120.0);
  }
}

// After the aborted set-ups above, this process still makes a working world of one.
TEST(Nccl, AWorldStillWorksAfterAbortedSetUps) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU: " << cuda::describe_device();
  within(120, "a world of one after aborts", [&] {
    DSV4_CUDA_CHECK(cudaSetDevice(0));
    NcclSetup setup;
    setup.timeout_s = 60;
    NcclCommunicator c(NcclCommunicator::unique_id(), 1, 0, 0, setup);
    cudaStream_t s;
    DSV4_CUDA_CHECK(cudaStreamCreate(&s));
    cuda::DeviceBuffer<int> mine(std::vector<int>{7, 8}), all(2);
    c.all_gather(mine.data(), all.data(), 8, s);
    std::unique_ptr<DeviceCommunicator> part = c.split(0, 0);
    cuda::DeviceBuffer<int> again(2);
    part->all_gather(all.data(), again.data(), 8, s);
    DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
    EXPECT_EQ(again.download(), (std::vector<int>{7, 8}));
    part.reset();
    cudaStreamDestroy(s);
  });
}

}  // namespace
}  // namespace dsv4::test
