// The engine loop: requests in, one step at a time: schedule -> run the batch on the Runner ->
// postprocess (append sampled tokens, check stops and lengths, finish, free). One thread
// drives it; the server's HTTP threads never call it directly.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/engine.h"
#include "model/runner.h"
#include "runtime/prefix_cache.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"

namespace dsv4 {

struct EngineLoopOptions {
  int max_running = 1;       // choices holding sequences at once, per data-parallel rank
  int max_step_tokens = 0;   // 0: the runner's, at most kDefaultStepTokens
  int64_t max_tokens = 0;    // per sequence (prompt + output); 0: the runner's context
  int prefix_snapshots = 0;  // prefix-cache snapshots per data-parallel rank (the runner has
                             // slots for them); 0: off
  int prefix_block = 256;
  int speculative_tokens = 0;  // MTP drafts per step, 0..kMaxDraftTokens (0: off)
  Rollback speculative_rollback = Rollback::kRestore;  // how rejected drafts are undone
  static constexpr int kDefaultStepTokens = 8192;
};

class EngineLoop {
 public:
  EngineLoop(std::unique_ptr<Runner> runner, const EngineLoopOptions& options);
  ~EngineLoop();

  const ModelInfo& info() const { return info_; }
  Runner& runner() { return *runner_; }

  // Validates and queues a request; throws dsv4::Error naming what is wrong. With
  // `prompt_logits` every prompt row's logits are kept (`chunk` tokens per step, 0: any),
  // for take_prompt_logits().
  uint64_t add(const std::vector<int32_t>& prompt, const SamplingOptions& sampling, int n = 1,
               bool prompt_logits = false, int chunk = 0);
  // Throws EngineFailed when the runner can go on no longer (a multi-node step failed): then
  // and on every later step() or add().
  std::vector<RequestOutput> step();
  void cancel(uint64_t id);
  // Requests not finished, or whose finish step() has not returned yet.
  bool has_work() const;
  EngineStats stats() const;
  // The kept logits of a finished prompt-logits request (removes it).
  std::vector<float> take_prompt_logits(uint64_t id);

 private:
  std::vector<RequestOutput> step_once();
  void validate(const std::vector<int32_t>& prompt, const SamplingOptions& s, int n) const;
  void postprocess(const std::vector<ScheduledChunk>& chunks, StepOutput& out);
  void fail(const std::vector<ScheduledChunk>& chunks, const std::string& why);
  void fail_request(Request& r, const std::string& why);
  void finish(Request& r, Choice& c, FinishReason why);
  void emit(std::vector<RequestOutput>& out);
  // The drafts a request's choices verify per step (0: none).
  int drafts_of(const Request& r) const;

  std::unique_ptr<Runner> runner_;
  EngineLoopOptions opt_;
  ModelInfo info_;
  std::vector<std::unique_ptr<PrefixCache>> prefix_;  // per data-parallel rank
  std::unique_ptr<Scheduler> sched_;
  std::map<uint64_t, std::unique_ptr<Request>> requests_;
  uint64_t next_id_ = 1;
  uint64_t arrivals_ = 0;
  EngineStats counters_;
  std::string fatal_;  // why the engine failed (EngineFailed); empty while it runs
};

}  // namespace dsv4
