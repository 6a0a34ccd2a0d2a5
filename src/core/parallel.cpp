#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace dsv4 {
namespace {
thread_local bool g_inside = false;  // this thread runs items of a parallel_for
}  // namespace

int cpu_threads() {
  if (const char* s = std::getenv("DSV4_CPU_THREADS")) {
    const long v = std::strtol(s, nullptr, 10);
    if (v > 0) return int(std::min<long>(v, 1024));
  }
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

void parallel_for(int64_t n, int64_t cost, const std::function<void(int64_t)>& body) {
  if (n <= 0) return;
  const int64_t threads =
      g_inside ? 1 : std::min<int64_t>({cpu_threads(), n, cost / (1 << 20) + 1});
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    const bool was_inside = g_inside;
    g_inside = true;
    for (int64_t i; !failed.load(std::memory_order_relaxed) && (i = next++) < n;) {
      try {
        body(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
    g_inside = was_inside;
  };
  std::vector<std::thread> pool;
  pool.reserve(size_t(threads - 1));
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace dsv4
