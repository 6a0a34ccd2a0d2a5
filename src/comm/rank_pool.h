// The parallel engine's ranks as threads: one thread per rank of this process, each running
// the jobs run_all() hands out, so a rank's collectives, device context and thread-local state
// stay on one thread for its whole life. Both parallel runners (CPU and CUDA) use it.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dsv4 {

class RankPool {
 public:
  // `ranks` threads. `enter(i)` runs on rank i's thread before each job (e.g. making its GPU
  // current); `failed(j)` for every rank j after any rank's job threw, on that rank's thread
  // (abort rank j's communicators, so the ranks waiting in a collective fail instead of waiting
  // forever; it may run for a rank more than once, and from another thread).
  RankPool(int ranks, std::function<void(int)> enter, std::function<void(int)> failed);
  ~RankPool();  // stop()
  RankPool(const RankPool&) = delete;
  RankPool& operator=(const RankPool&) = delete;

  int size() const { return int(threads_.size()); }
  // Runs job(i) on every rank's thread and waits for all; rethrows the failure that caused the
  // others (comm/first_failure.h).
  // `watch`, when given, runs on the calling thread every ~100 ms until the job ends (the
  // multi-node control plane watches the other nodes with it, and may abort() the ranks). If
  // `watch` throws, the ranks are aborted and waited for, then its error is rethrown.
  void run_all(const std::function<void(int)>& job, const std::function<void()>& watch = {});
  // Calls `failed(i)` for every rank from the calling thread (their communicators abort, so
  // ranks blocked in collectives return with errors): another node failed.
  void abort();
  // Joins the threads (idempotent); run_all() after it is an error.
  void stop();

 private:
  void worker(int i);

  std::function<void(int)> enter_, failed_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t job_id_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
};

}  // namespace dsv4
