// The link between one HTTP request and the engine loop: the loop pushes events (admitted or
// refused, then every output of every choice), the HTTP thread waits for them. One HTTP request
// may hold several engine requests ("jobs": the prompts of a /v1/completions list).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "dsv4/engine.h"

namespace dsv4::server {

using Clock = std::chrono::steady_clock;

// One engine request: the prompt, how to sample, and how many choices.
struct Job {
  std::vector<int32_t> prompt;
  SamplingOptions sampling;
  int n = 1;
};

struct ChannelEvent {
  enum Kind {
    kAdmitted,  // every job was queued in the engine
    kRefused,   // the engine refused a job (`error`, a bad request); nothing runs
    kOutput,    // `output` of job `job`
    kFailed,    // the engine loop failed or stopped (`error`): every open choice ends
  };
  Kind kind = kOutput;
  int job = 0;
  RequestOutput output;
  std::string error;
  int status = 500;        // kFailed, kRefused: the HTTP status it means (400: can never run)
  Clock::time_point time;  // when the engine loop produced it
};

class RequestChannel {
 public:
  explicit RequestChannel(std::vector<Job> jobs) : jobs_(std::move(jobs)) {}

  const std::vector<Job>& jobs() const { return jobs_; }
  Clock::time_point arrival() const { return arrival_; }

  void push(ChannelEvent e) {
    {
      std::lock_guard<std::mutex> l(mu_);
      events_.push_back(std::move(e));
    }
    cv_.notify_one();
  }
  // The events so far, waiting up to `timeout` for the first one (empty on timeout).
  std::vector<ChannelEvent> wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, timeout, [&] { return !events_.empty(); });
    std::vector<ChannelEvent> out(std::make_move_iterator(events_.begin()),
                                  std::make_move_iterator(events_.end()));
    events_.clear();
    return out;
  }

 private:
  const std::vector<Job> jobs_;
  const Clock::time_point arrival_ = Clock::now();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ChannelEvent> events_;
};

}  // namespace dsv4::server
