#include "comm/rank_pool.h"

#include <chrono>

#include "comm/first_failure.h"
#include "core/error.h"

namespace dsv4 {

RankPool::RankPool(int ranks, std::function<void(int)> enter, std::function<void(int)> failed)
    : enter_(std::move(enter)), failed_(std::move(failed)) {
  DSV4_CHECK(ranks >= 1, "rank pool of ", ranks, " threads");
  for (int i = 0; i < ranks; ++i) threads_.emplace_back([this, i] { worker(i); });
}

RankPool::~RankPool() {
  stop();
}

void RankPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_)
    if (t.joinable()) t.join();
}

void RankPool::abort() {
  if (!failed_) return;
  for (int i = 0; i < size(); ++i) try {
      failed_(i);
    } catch (...) {
    }
}

void RankPool::worker(int i) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || job_id_ != seen; });
      if (stop_) return;
      seen = job_id_;
      job = job_;
    }
    std::exception_ptr err;
    try {
      if (enter_) enter_(i);
      (*job)(i);
    } catch (...) {
      err = std::current_exception();
      // Every rank of this process, not only this one: an NCCL abort does not reach the other
      // ranks of a communicator, which would otherwise keep waiting in the collective.
      abort();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (err) errors_[size_t(i)] = err;
    if (--pending_ == 0) done_cv_.notify_all();
  }
}

void RankPool::run_all(const std::function<void(int)>& job, const std::function<void()>& watch) {
  std::unique_lock<std::mutex> lock(mu_);
  DSV4_CHECK(!stop_, "the parallel engine's rank threads have stopped");
  errors_.assign(threads_.size(), nullptr);
  job_ = &job;
  pending_ = int(threads_.size());
  ++job_id_;
  cv_.notify_all();
  std::exception_ptr watch_error;
  if (watch) {
    while (
        !done_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return pending_ == 0; })) {
      lock.unlock();
      try {
        watch();
      } catch (...) {
        // The ranks still run `job`: abort them and wait for every one before leaving, so no
        // worker outlives the job it points at or overlaps the next run_all.
        watch_error = std::current_exception();
        abort();
        lock.lock();
        break;
      }
      lock.lock();
    }
  }
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  if (watch_error) std::rethrow_exception(watch_error);
  if (std::exception_ptr first = first_failure(errors_)) std::rethrow_exception(first);
}

}  // namespace dsv4
