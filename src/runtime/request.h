// A request inside the engine loop: its prompt, options and choices. A choice is the unit the
// scheduler runs: one runner sequence holding prompt + output in the cache. With n > 1 the
// choices share the prompt's pages: choice 0 prefills all but the last prompt token, is
// forked n - 1 times, and every choice then brings the last prompt token and samples.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "dsv4/engine.h"
#include "model/runner.h"
#include "ops/common/sampling.h"

namespace dsv4 {

struct Choice {
  int index = 0;
  int seq = -1;                        // runner sequence; -1 while the choice holds no cache
  std::vector<int32_t> output;         // sampled so far
  size_t reported = 0;                 // output[0, reported) went out in earlier step() results
  std::vector<TokenLogprob> logprobs;  // of output[reported..] (when asked)
  SamplingParams params;               // the request's, with this choice's seed
  TokenCounts counts;                  // penalties' history (only when penalised)
  std::unordered_map<int32_t, size_t> count_at;  // token -> index into counts.output
  SampleSpec spec;                               // points into params / counts
  std::vector<int32_t> drafts;  // speculative decoding: proposed to follow output.back()
  FinishReason finish = FinishReason::kNone;
  std::string error;
  bool unschedulable = false;  // failed because the cache can never hold the request
  bool finish_reported = false;
};

struct Request {
  uint64_t id = 0;
  uint64_t arrival = 0;  // admission order (FCFS)
  std::vector<int32_t> prompt;
  SamplingOptions opts;
  std::vector<Choice> choices;
  bool forked = false;        // n > 1: the choices have their own sequences
  bool admitted = false;      // choice 0 was admitted once
  int64_t cached_tokens = 0;  // prompt tokens its first admission found in the prefix cache
  // Engine::prompt_logits: every prompt row's logits, `chunk` tokens per step (0: any).
  bool want_prompt_logits = false;
  int chunk = 0;
  std::vector<float> prompt_logits;
  // SamplingOptions::prompt_logprobs: collected by choice 0's prefill, reported once.
  std::vector<TokenLogprob> prompt_logprobs;
  bool prompt_logprobs_reported = false;

  int64_t prompt_len() const { return int64_t(prompt.size()); }
  // Choice c's prefill still has prompt logprobs to collect.
  bool scores_prompt(const Choice& c) const {
    return opts.prompt_logprobs >= 0 && c.index == 0 &&
           int64_t(prompt_logprobs.size()) < prompt_len() - 1;
  }
  // The chunk's rows need logits (every row: prompt logits or prompt logprobs).
  bool wants_rows(const Choice& c) const { return want_prompt_logits || scores_prompt(c); }
  bool finished() const {
    for (const Choice& c : choices)
      if (c.finish == FinishReason::kNone) return false;
    return true;
  }
};

}  // namespace dsv4
