#include "server/engine_worker.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "core/error.h"
#include "server/api_error.h"

namespace dsv4::server {

EngineWorker::EngineWorker(EngineOptions options, int max_waiting,
                           std::function<void(const ModelInfo&)> on_loaded)
    : options_(std::move(options)), max_waiting_(max_waiting), on_loaded_(std::move(on_loaded)) {}

EngineWorker::~EngineWorker() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
    admitting_ = false;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void EngineWorker::start() {
  thread_ = std::thread([this] { loop(); });
}

EngineWorker::State EngineWorker::state() const {
  std::lock_guard<std::mutex> l(mu_);
  return state_;
}

std::string EngineWorker::load_error() const {
  std::lock_guard<std::mutex> l(mu_);
  return load_error_;
}

bool EngineWorker::engine_failed() const {
  std::lock_guard<std::mutex> l(mu_);
  return !engine_error_.empty();
}

std::string EngineWorker::failure() const {
  std::lock_guard<std::mutex> l(mu_);
  return engine_error_.empty() ? "the model failed to load: " + load_error_ : engine_error_;
}

std::shared_ptr<RequestChannel> EngineWorker::submit(std::vector<Job> jobs) {
  const int n = int(jobs.size());
  auto ch = std::make_shared<RequestChannel>(std::move(jobs));
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!engine_error_.empty()) throw ApiError(503, engine_error_);
    if (state_ != State::kReady) throw ApiError(503, "the model is loading");
    if (!admitting_) throw ApiError(503, "the server is shutting down");
    // Requests that would wait for a running slot once everything queued is admitted (FCFS).
    const int free_slots = std::max(0, options_.max_sequences - snapshot_.stats.running);
    const int queued = snapshot_.stats.waiting - inbox_jobs_ - transit_jobs_;  // in the engine
    const int would_wait = std::max(0, queued + inbox_jobs_ + transit_jobs_ + n - free_slots);
    if (would_wait > max_waiting_)
      throw ApiError(429, cat("too many requests: ", max_waiting_,
                              " are waiting already (--max-waiting); retry later"));
    inbox_.push_back(ch);
    inbox_jobs_ += n;
    snapshot_.stats.waiting += n;
    ++snapshot_.in_flight;
  }
  cv_.notify_all();
  return ch;
}

void EngineWorker::cancel(const std::shared_ptr<RequestChannel>& channel) {
  {
    std::lock_guard<std::mutex> l(mu_);
    cancels_.push_back(channel);
  }
  cv_.notify_all();
}

EngineWorker::Snapshot EngineWorker::snapshot() const {
  std::lock_guard<std::mutex> l(mu_);
  return snapshot_;
}

void EngineWorker::stop_admitting() {
  std::lock_guard<std::mutex> l(mu_);
  admitting_ = false;
}

void EngineWorker::admit(const std::shared_ptr<RequestChannel>& ch) {
  std::vector<uint64_t> ids;
  ChannelEvent e;
  e.kind = ChannelEvent::kAdmitted;
  for (size_t j = 0; j < ch->jobs().size(); ++j) {
    const Job& job = ch->jobs()[j];
    try {
      ids.push_back(engine_->add_request(job.prompt, job.sampling, job.n));
    } catch (const Error& err) {
      for (uint64_t id : ids) engine_->cancel(id);  // the request is refused as a whole
      for (uint64_t id : ids) routes_.erase(id);
      e.kind = ChannelEvent::kRefused;
      e.status = 400;
      e.error = ch->jobs().size() > 1 ? cat("prompt ", j, ": ", err.what()) : err.what();
      break;
    }
    routes_[ids.back()] = Route{ch, int(j), job.n};
  }
  e.time = Clock::now();
  ch->push(std::move(e));
}

void EngineWorker::dispatch(std::vector<RequestOutput> outputs) {
  const Clock::time_point now = Clock::now();
  for (RequestOutput& o : outputs) {
    auto it = routes_.find(o.request);
    if (it == routes_.end()) continue;  // refused or already done
    Route& r = it->second;
    const bool done = o.finish != FinishReason::kNone;
    ChannelEvent e;
    e.kind = ChannelEvent::kOutput;
    e.job = r.job;
    e.output = std::move(o);
    e.time = now;
    r.channel->push(std::move(e));
    if (done && --r.open_choices == 0) routes_.erase(it);
  }
}

void EngineWorker::fail_all(const std::string& why, int status) {
  std::set<RequestChannel*> told;
  for (const auto& [id, r] : routes_) {
    if (!told.insert(r.channel.get()).second) continue;
    ChannelEvent e;
    e.kind = ChannelEvent::kFailed;
    e.status = status;
    e.error = why;
    e.time = Clock::now();
    r.channel->push(std::move(e));
  }
  routes_.clear();
}

void EngineWorker::publish() {
  // Runs after every step: the distinct channels of the routes, without a tree node each.
  std::vector<const RequestChannel*> live;
  live.reserve(routes_.size());
  for (const auto& [id, r] : routes_) live.push_back(r.channel.get());
  std::sort(live.begin(), live.end());
  live.erase(std::unique(live.begin(), live.end()), live.end());
  const EngineStats s = engine_->stats();
  {
    std::lock_guard<std::mutex> l(mu_);
    snapshot_.stats = s;
    snapshot_.stats.waiting += inbox_jobs_;
    snapshot_.in_flight = int(live.size() + inbox_.size());
    transit_jobs_ = 0;
    engine_has_work_ = engine_->has_work();
  }
}

void EngineWorker::fail_engine(const std::string& why) {
  const std::string error =
      cat("the engine failed", options_.nnodes > 1 ? " (restart every node)" : "", ": ", why);
  std::fprintf(stderr, "dsv4 serve: %s\n", error.c_str());
  // The state first: a client told of the failure and asking /health at once sees 503.
  std::vector<std::shared_ptr<RequestChannel>> queued;
  {
    std::lock_guard<std::mutex> l(mu_);
    engine_error_ = error;
    state_ = State::kFailed;
    queued.swap(inbox_);
    inbox_jobs_ = transit_jobs_ = 0;
    snapshot_.stats.running = snapshot_.stats.waiting = 0;
    snapshot_.in_flight = 0;
    engine_has_work_ = false;
  }
  fail_all(error, 503);
  for (const auto& ch : queued) {
    ChannelEvent e;
    e.kind = ChannelEvent::kRefused;
    e.status = 503;
    e.error = error;
    ch->push(std::move(e));
  }
  // Nothing can run on it; destroying it tells the other nodes (their runs fail too).
  engine_.reset();
}

void EngineWorker::loop() {
  try {
    engine_ = Engine::open(options_);
    if (on_loaded_) on_loaded_(engine_->info());
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> l(mu_);
      state_ = State::kFailed;
      load_error_ = e.what();
    }
    return;
  }
  publish();  // the engine's counters from the start (speculative decoding's, when on)
  {
    std::lock_guard<std::mutex> l(mu_);
    state_ = State::kReady;
  }
  std::vector<std::shared_ptr<RequestChannel>> batch, cancels;
  for (;;) {
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l,
               [&] { return stop_ || !inbox_.empty() || !cancels_.empty() || engine_has_work_; });
      if (stop_) break;
      batch.swap(inbox_);
      cancels.swap(cancels_);
      transit_jobs_ = inbox_jobs_;
      inbox_jobs_ = 0;
    }
    // Admissions first, so that a cancel queued right after its submit finds the request.
    for (const auto& ch : batch) admit(ch);
    for (const auto& ch : cancels)
      for (const auto& [id, r] : routes_)
        if (r.channel == ch) engine_->cancel(id);
    batch.clear();
    cancels.clear();
    if (engine_->has_work()) {
      try {
        std::vector<RequestOutput> outputs = engine_->step();
        // (A request the cache can never hold comes back failed, `unschedulable`: a 400.)
        dispatch(std::move(outputs));
      } catch (const EngineFailed& e) {
        fail_engine(e.what());
        return;
      } catch (const std::exception& e) {
        // The engine reports a failed step per request (FinishReason::kError); anything else
        // is a bug: every request in flight fails with it, and the server goes on.
        std::fprintf(stderr, "dsv4 serve: engine step failed: %s\n", e.what());
        for (const auto& [id, r] : routes_) engine_->cancel(id);
        fail_all(e.what());
      }
    }
    publish();
  }
  // Stopped: whatever is left is aborted.
  for (const auto& [id, r] : routes_) engine_->cancel(id);
  fail_all("the server stopped");
  {
    std::lock_guard<std::mutex> l(mu_);
    batch.swap(inbox_);
  }
  for (const auto& ch : batch) {
    ChannelEvent e;
    e.kind = ChannelEvent::kRefused;
    e.status = 400;
    e.error = "the server stopped";
    ch->push(std::move(e));
  }
  while (engine_->has_work()) engine_->step();
  engine_.reset();
}

}  // namespace dsv4::server
