// The engine loop thread, the only thread that touches the Engine (which is not thread-safe):
// it opens the model, then loops: admit what the HTTP threads queued, apply cancellations, run
// one engine step, hand every output to its request's channel, publish the engine's stats.
// HTTP threads only queue (submit, cancel) and read the published snapshot.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dsv4/engine.h"
#include "server/request_channel.h"

namespace dsv4::server {

class EngineWorker {
 public:
  enum class State { kLoading, kReady, kFailed };

  // `on_loaded` runs on the loop thread once the engine is open (e.g. to load the tokenizer);
  // if it throws, loading failed. `max_running` / `max_waiting` bound admission (submit()).
  EngineWorker(EngineOptions options, int max_waiting,
               std::function<void(const ModelInfo&)> on_loaded);
  ~EngineWorker();  // stops the loop (in-flight requests are cancelled)

  void start();  // spawns the loop thread, which loads the model
  // kFailed: the model failed to load, or later the engine failed (EngineFailed: a
  // multi-node step failed): every request in flight failed with it, new ones get 503, and the
  // loop has ended (the server should exit non-zero).
  State state() const;
  std::string load_error() const;
  bool engine_failed() const;  // kFailed after the model had loaded
  // What kFailed means, as a sentence for a 503 or the exit message.
  std::string failure() const;

  // Queues the jobs of one HTTP request. Throws ApiError: 503 while loading or after
  // stop_admitting(), 429 when more than max_waiting requests would wait for a running slot.
  std::shared_ptr<RequestChannel> submit(std::vector<Job> jobs);
  // Aborts the channel's engine requests (their pages are freed at once).
  void cancel(const std::shared_ptr<RequestChannel>& channel);

  struct Snapshot {
    EngineStats stats;  // waiting also counts requests queued and not yet in the engine
    int in_flight = 0;  // HTTP requests with engine work not finished
  };
  Snapshot snapshot() const;

  void stop_admitting();

 private:
  struct Route {
    std::shared_ptr<RequestChannel> channel;
    int job = 0;
    int open_choices = 0;
  };

  void loop();
  void admit(const std::shared_ptr<RequestChannel>& ch);
  void dispatch(std::vector<RequestOutput> outputs);
  void publish();
  void fail_all(const std::string& why, int status = 500);  // kFailed to every channel in flight
  void fail_engine(const std::string& why);                 // EngineFailed: see state()

  const EngineOptions options_;
  const int max_waiting_;
  std::function<void(const ModelInfo&)> on_loaded_;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // wakes the loop
  State state_ = State::kLoading;
  std::string load_error_;
  std::string engine_error_;  // set by fail_engine()
  bool admitting_ = true, stop_ = false;
  std::vector<std::shared_ptr<RequestChannel>> inbox_;
  std::vector<std::shared_ptr<RequestChannel>> cancels_;
  int inbox_jobs_ = 0, transit_jobs_ = 0;  // queued / being admitted, not in the stats yet
  Snapshot snapshot_;
  bool engine_has_work_ = false;

  // Loop thread only.
  std::unique_ptr<Engine> engine_;
  std::map<uint64_t, Route> routes_;  // engine request -> its channel
  std::thread thread_;
};

}  // namespace dsv4::server
