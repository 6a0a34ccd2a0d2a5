// Ranks as threads in a test: body(r) for each rank r < n on a thread of its own. An exception in
// a rank's thread is that rank's failure, reported (never std::terminate: the remaining tests
// still run).
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace dsv4::test {

inline void on_each_rank(int n, const std::function<void(int)>& body) {
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      } catch (...) {
        errors[size_t(r)] = "a non-standard exception";
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r)
    EXPECT_TRUE(errors[size_t(r)].empty()) << "rank " << r << " threw: " << errors[size_t(r)];
}

}  // namespace dsv4::test
