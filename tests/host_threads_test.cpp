// parallel_for (core/parallel.h) and the CPU reference linear run on it: every item exactly once,
// nested calls inline, errors rethrown, and the linear's bits independent of the thread count.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/parallel.h"
#include "ops/cpu/linear.h"
#include "support/random_values.h"

namespace dsv4 {
namespace {

// Sets DSV4_CPU_THREADS for the scope of one test.
class ThreadsEnv {
 public:
  explicit ThreadsEnv(const char* v) { setenv("DSV4_CPU_THREADS", v, 1); }
  ~ThreadsEnv() { unsetenv("DSV4_CPU_THREADS"); }
};

TEST(ParallelFor, EveryItemOnceOnSeveralThreads) {
  ThreadsEnv env("4");
  EXPECT_EQ(cpu_threads(), 4);
  const int64_t n = 1000;
  std::vector<std::atomic<int>> seen(n);
  std::mutex m;
  std::set<std::thread::id> ids;
  parallel_for(n, int64_t(1) << 30, [&](int64_t i) {
    seen[size_t(i)]++;
    std::lock_guard<std::mutex> lock(m);
    ids.insert(std::this_thread::get_id());
    std::this_thread::yield();
  });
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[size_t(i)].load(), 1) << i;
  EXPECT_GE(ids.size(), 1u);
  EXPECT_LE(ids.size(), 4u);
}

TEST(ParallelFor, SmallWorkAndNestedCallsStayOnTheCallingThread) {
  ThreadsEnv env("4");
  const std::thread::id self = std::this_thread::get_id();
  bool elsewhere = false;
  parallel_for(100, 1000, [&](int64_t) { elsewhere |= std::this_thread::get_id() != self; });
  EXPECT_FALSE(elsewhere) << "work below one thread's share ran on another thread";
  std::atomic<int> wrong{0}, inner{0};
  parallel_for(8, int64_t(1) << 30, [&](int64_t) {
    const std::thread::id outer = std::this_thread::get_id();
    parallel_for(16, int64_t(1) << 30, [&](int64_t) {
      inner++;
      if (std::this_thread::get_id() != outer) wrong++;
    });
  });
  EXPECT_EQ(inner.load(), 8 * 16);
  EXPECT_EQ(wrong.load(), 0) << "a nested parallel_for started threads of its own";
  parallel_for(0, int64_t(1) << 30, [&](int64_t) { FAIL() << "no items"; });
}

TEST(ParallelFor, FirstErrorRethrownAfterAllStop) {
  ThreadsEnv env("4");
  std::atomic<int> running{0};
  try {
    parallel_for(64, int64_t(1) << 30, [&](int64_t i) {
      running++;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      running--;
      if (i == 5) throw std::runtime_error("item 5");
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "item 5");
  }
  EXPECT_EQ(running.load(), 0) << "an item still ran after parallel_for returned";
}

TEST(ParallelFor, BadThreadCountsFallBackToTheHardware) {
  {
    ThreadsEnv env("0");
    EXPECT_GE(cpu_threads(), 1);
  }
  {
    ThreadsEnv env("junk");
    EXPECT_GE(cpu_threads(), 1);
  }
}

// The reference linear's output is the same bits on one thread and on several, at edge sizes
// (rows not a multiple of its 8-row tile, columns not of its 256-column chunk) and for every
// weight kind.
TEST(ParallelFor, CpuLinearBitsIndependentOfThreads) {
  std::mt19937 rng(7);
  for (cpu::LinearKind kind : {cpu::LinearKind::kFp8, cpu::LinearKind::kFp4, cpu::LinearKind::kBf16,
                               cpu::LinearKind::kF32})
    for (int m : {1, 13, 64}) {
      const int N = 600, K = 512;
      const cpu::Linear l =
          cpu::Linear::from_rows(kind, N, K, test::gaussian(size_t(N) * K, 0.05f, rng, true));
      const std::vector<float> x = test::gaussian(size_t(m) * K, 1.0f, rng, true);
      std::vector<float> one(size_t(m) * N, -1.0f), many(size_t(m) * N, -2.0f);
      {
        ThreadsEnv env("1");
        cpu::linear(l, x.data(), m, one.data());
      }
      {
        ThreadsEnv env("5");
        cpu::linear(l, x.data(), m, many.data());
      }
      for (size_t i = 0; i < one.size(); ++i)
        ASSERT_EQ(one[i], many[i]) << "kind " << int(kind) << " m " << m << " at " << i;
    }
}

}  // namespace
}  // namespace dsv4
