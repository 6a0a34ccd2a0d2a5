#include "runtime/engine_loop.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "core/error.h"

namespace dsv4 {

static_assert(kMaxSpeculativeTokens == kMaxDraftTokens, "the engine's and the runner's limits");

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kError:
      return "error";
    case FinishReason::kNone:
      break;
  }
  return "";
}

EngineLoop::EngineLoop(std::unique_ptr<Runner> runner, const EngineLoopOptions& o)
    : runner_(std::move(runner)), opt_(o) {
  DSV4_CHECK(runner_ != nullptr, "engine loop without a runner");
  DSV4_CHECK(o.max_running > 0 && o.max_step_tokens >= 0 && o.max_tokens >= 0,
             "engine loop: bad options");
  DSV4_CHECK(o.speculative_tokens >= 0 && o.speculative_tokens <= kMaxDraftTokens,
             "speculative tokens must be in [0, ", kMaxDraftTokens, "], got ",
             o.speculative_tokens);
  // Before any sequence is opened: the MTP block's cache is kept from the first token on.
  if (o.speculative_tokens > 0) runner_->enable_speculation(o.speculative_rollback);
  counters_.spec_accepted_per_pos.assign(size_t(o.speculative_tokens), 0);
  const ModelConfig& c = runner_->config();
  info_.vocab_size = c.vocab_size;
  info_.bos_token_id = c.bos_token_id;
  info_.eos_token_id = c.eos_token_id;
  info_.num_layers = c.n_layers;
  info_.num_mtp_layers = c.n_mtp_layers;
  info_.expert_format = c.moe_quant_algo.empty() ? "MXFP4" : c.moe_quant_algo;
  opt_.max_tokens = opt_.max_tokens > 0 ? std::min(opt_.max_tokens, runner_->max_context())
                                        : runner_->max_context();
  info_.max_tokens = opt_.max_tokens;
  SchedulerOptions so;
  so.max_running = o.max_running;
  so.max_step_tokens =
      std::min(runner_->max_step_tokens(),
               o.max_step_tokens > 0 ? o.max_step_tokens : EngineLoopOptions::kDefaultStepTokens);
  so.max_step_seqs = runner_->max_step_seqs();
  so.max_logit_rows = runner_->max_logit_rows();
  std::vector<PrefixCache*> caches;
  for (int g = 0; g < runner_->dp_size(); ++g) {
    prefix_.push_back(
        std::make_unique<PrefixCache>(*runner_, o.prefix_block, o.prefix_snapshots, g));
    caches.push_back(prefix_.back().get());
  }
  sched_ = std::make_unique<Scheduler>(*runner_, so, caches);
}

EngineLoop::~EngineLoop() {
  // Sequences go back to the runner before it is destroyed.
  for (auto& [id, r] : requests_) sched_->remove(r.get());
  for (auto& p : prefix_) p->clear();
}

void EngineLoop::validate(const std::vector<int32_t>& prompt, const SamplingOptions& s,
                          int n) const {
  const int V = info_.vocab_size;
  DSV4_CHECK(!prompt.empty(), "empty prompt");
  for (int32_t t : prompt)
    DSV4_CHECK(t >= 0 && t < V, "token id ", t, " out of range [0, ", V, ")");
  DSV4_CHECK(s.max_new_tokens >= 0, "max_new_tokens must be >= 0");
  DSV4_CHECK(int64_t(prompt.size()) + s.max_new_tokens <= opt_.max_tokens, "prompt of ",
             prompt.size(), " tokens plus ", s.max_new_tokens, " new ones exceeds max_tokens ",
             opt_.max_tokens);
  DSV4_CHECK(n >= 1 && n <= opt_.max_running, "n must be in [1, ", opt_.max_running, "], got ", n);
  DSV4_CHECK(std::isfinite(s.temperature) && s.temperature >= 0, "temperature must be >= 0");
  DSV4_CHECK(s.top_k >= 0, "top_k must be >= 0");
  DSV4_CHECK(std::isfinite(s.top_p) && s.top_p > 0 && s.top_p <= 1, "top_p must be in (0, 1]");
  DSV4_CHECK(std::isfinite(s.min_p) && s.min_p >= 0 && s.min_p <= 1, "min_p must be in [0, 1]");
  DSV4_CHECK(std::isfinite(s.presence_penalty) && std::isfinite(s.frequency_penalty),
             "presence and frequency penalties must be finite");
  DSV4_CHECK(std::isfinite(s.repetition_penalty) && s.repetition_penalty > 0,
             "repetition_penalty must be > 0");
  DSV4_CHECK(s.top_logprobs >= 0 && s.top_logprobs <= kMaxTopLogprobs,
             "top_logprobs must be in [0, ", kMaxTopLogprobs, "]");
  DSV4_CHECK(s.prompt_logprobs >= -1 && s.prompt_logprobs <= kMaxTopLogprobs,
             "prompt_logprobs must be in [-1, ", kMaxTopLogprobs, "]");
  for (const auto& [t, b] : s.logit_bias)
    DSV4_CHECK(t >= 0 && t < V && std::isfinite(b), "logit_bias token ", t, " out of range [0, ", V,
               ") or bias not finite");
  for (int32_t t : s.stop_token_ids)
    DSV4_CHECK(t >= 0 && t < V, "stop token ", t, " out of range [0, ", V, ")");
  for (int32_t t : s.forced_output)
    DSV4_CHECK(t >= 0 && t < V, "forced token ", t, " out of range [0, ", V, ")");
  for (int32_t t : s.forced_drafts)
    DSV4_CHECK(t >= 0 && t < V, "forced draft ", t, " out of range [0, ", V, ")");
  DSV4_CHECK(s.speculative_tokens >= -1 && s.speculative_tokens <= kMaxDraftTokens,
             "speculative_tokens must be in [-1, ", kMaxDraftTokens, "], got ",
             s.speculative_tokens);
}

int EngineLoop::drafts_of(const Request& r) const {
  return r.opts.speculative_tokens < 0
             ? opt_.speculative_tokens
             : std::min(r.opts.speculative_tokens, opt_.speculative_tokens);
}

uint64_t EngineLoop::add(const std::vector<int32_t>& prompt, const SamplingOptions& s, int n,
                         bool prompt_logits, int chunk) {
  if (!fatal_.empty()) throw EngineFailed(fatal_);
  validate(prompt, s, n);
  DSV4_CHECK(chunk >= 0, "prefill chunk must be >= 0");
  auto r = std::make_unique<Request>();
  r->id = next_id_++;
  r->arrival = arrivals_++;
  r->prompt = prompt;
  r->opts = s;
  r->want_prompt_logits = prompt_logits;
  r->chunk = chunk;
  r->forked = n == 1 || prompt.size() == 1;  // nothing to share
  r->choices.resize(size_t(n));
  std::vector<int32_t> distinct;
  for (int i = 0; i < n; ++i) {
    Choice& c = r->choices[size_t(i)];
    c.index = i;
    SamplingParams& p = c.params;
    p.temperature = s.temperature;
    p.top_k = s.top_k;
    p.top_p = s.top_p;
    p.min_p = s.min_p;
    p.presence_penalty = s.presence_penalty;
    p.frequency_penalty = s.frequency_penalty;
    p.repetition_penalty = s.repetition_penalty;
    p.logit_bias = s.logit_bias;
    // Choice 0 draws with the request's seed; the others with seeds derived from it.
    p.seed = i == 0 ? s.seed : splitmix64(s.seed ^ splitmix64(uint64_t(i)));
    p.logprobs = s.logprobs;
    p.top_logprobs = s.top_logprobs;
    if (p.penalised()) {
      if (distinct.empty()) {
        std::set<int32_t> d(prompt.begin(), prompt.end());
        distinct.assign(d.begin(), d.end());
      }
      c.counts.prompt = distinct;
    }
  }
  Request* raw = r.get();
  requests_.emplace(raw->id, std::move(r));
  if (s.max_new_tokens == 0 && !prompt_logits && s.prompt_logprobs < 0) {
    for (Choice& c : raw->choices) c.finish = FinishReason::kLength;  // nothing to run
  } else {
    sched_->add(raw);
  }
  return raw->id;
}

void EngineLoop::cancel(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  Request& r = *it->second;
  sched_->remove(&r);
  for (Choice& c : r.choices)
    if (c.finish == FinishReason::kNone) c.finish = FinishReason::kAbort;
}

void EngineLoop::finish(Request& r, Choice& c, FinishReason why) {
  c.finish = why;
  sched_->finish(&r, &c);
}

void EngineLoop::fail_request(Request& r, const std::string& why) {
  sched_->remove(&r);
  for (Choice& c : r.choices)
    if (c.finish == FinishReason::kNone) c.finish = FinishReason::kError, c.error = why;
}

void EngineLoop::fail(const std::vector<ScheduledChunk>& chunks, const std::string& why) {
  std::set<Request*> failed;
  for (const ScheduledChunk& ch : chunks) failed.insert(ch.request);
  for (Request* r : failed) fail_request(*r, why);
}

void EngineLoop::postprocess(const std::vector<ScheduledChunk>& chunks, StepOutput& out) {
  const int V = info_.vocab_size;
  size_t row = 0, sample = 0, score = 0;
  std::set<Request*> touched;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ScheduledChunk& ch = chunks[i];
    Request& r = *ch.request;
    Choice& c = *ch.choice;
    if (i < out.errors.size() && !out.errors[i].empty()) {
      // Garbage is never sampled from: the choice (before an n > 1 fork: the request) fails,
      // the others go on.
      if (r.want_prompt_logits) row += size_t(ch.n);
      if (r.scores_prompt(c)) ++score;
      if (ch.sample) ++sample;
      const std::string why = cat(out.errors[i], ", output token ", c.output.size());
      if (r.choices.size() > 1 && !r.forked) {
        fail_request(r, why);
      } else {
        c.error = why;
        finish(r, c, FinishReason::kError);
      }
      continue;
    }
    touched.insert(&r);
    if (r.want_prompt_logits) {
      r.prompt_logits.insert(r.prompt_logits.end(), out.logits.begin() + row * V,
                             out.logits.begin() + (row + size_t(ch.n)) * V);
      row += size_t(ch.n);
    }
    if (r.scores_prompt(c)) {
      for (const SampledToken& s : out.scores.at(score++))
        if (s.id >= 0) r.prompt_logprobs.push_back({s.id, s.logprob, s.top});
    }
    if (ch.sample) {
      const size_t si = sample++;
      // The sample, then (a verify) one token per accepted draft; a stop among them drops
      // the rest.
      std::vector<const SampledToken*> emitted{&out.samples.at(si)};
      if (si < out.more.size())
        for (const SampledToken& t : out.more[si]) emitted.push_back(&t);
      if (ch.drafts > 0) {
        const size_t accepted = emitted.size() - 1;
        ++counters_.spec_drafts;
        counters_.spec_draft_tokens += ch.drafts;
        counters_.spec_accepted_tokens += int64_t(accepted);
        for (size_t j = 0; j < accepted; ++j) ++counters_.spec_accepted_per_pos[j];
      }
      FinishReason why = FinishReason::kNone;
      for (const SampledToken* tp : emitted) {
        const SampledToken& t = *tp;
        if (c.output.empty()) counters_.prompt_tokens += r.prompt_len();
        c.output.push_back(t.id);
        ++counters_.generation_tokens;
        if (c.params.logprobs || c.params.top_logprobs > 0)
          c.logprobs.push_back({t.id, t.logprob, t.top});
        if (c.params.penalised()) {
          auto [it, fresh] = c.count_at.emplace(t.id, c.counts.output.size());
          if (fresh)
            c.counts.output.emplace_back(t.id, 1);
          else
            ++c.counts.output[it->second].second;
        }
        const SamplingOptions& o = r.opts;
        const bool stop = (o.stop_at_eos && t.id == info_.eos_token_id) ||
                          std::find(o.stop_token_ids.begin(), o.stop_token_ids.end(), t.id) !=
                              o.stop_token_ids.end();
        if (stop)
          why = FinishReason::kStop;
        else if (int64_t(c.output.size()) >= o.max_new_tokens ||
                 r.prompt_len() + int64_t(c.output.size()) >= opt_.max_tokens)
          why = FinishReason::kLength;
        if (why != FinishReason::kNone) break;
      }
      sched_->snapshot(ch);  // the chunk's tokens are known now; before a finish closes it
      c.drafts.clear();
      if (why != FinishReason::kNone) {
        finish(r, c, why);
      } else if (si < out.drafts.size()) {
        // The next step verifies 1 + drafts tokens: within max_new_tokens and max_tokens.
        const int64_t room =
            std::min<int64_t>(r.opts.max_new_tokens - int64_t(c.output.size()) - 1,
                              opt_.max_tokens - r.prompt_len() - int64_t(c.output.size()));
        const std::vector<int32_t>& d = out.drafts[si];
        c.drafts.assign(d.begin(),
                        d.begin() + long(std::clamp<int64_t>(room, 0, int64_t(d.size()))));
      }
    } else {
      sched_->snapshot(ch);  // before a finish closes the sequence
      if (ch.start + ch.n == Scheduler::target(r, c) &&
          int64_t(c.output.size()) >= r.opts.max_new_tokens && c.finish == FinishReason::kNone) {
        if (c.output.empty()) counters_.prompt_tokens += r.prompt_len();
        finish(r, c, FinishReason::kLength);  // prompt logits only
      }
    }
  }
  for (Request* r : touched)
    if (!r->finished()) sched_->after_step(r);
}

void EngineLoop::emit(std::vector<RequestOutput>& out) {
  for (auto it = requests_.begin(); it != requests_.end();) {
    Request& r = *it->second;
    for (Choice& c : r.choices) {
      const bool fresh = c.reported < c.output.size();
      const bool done = c.finish != FinishReason::kNone && !c.finish_reported;
      if (!fresh && !done) continue;
      RequestOutput o;
      o.request = r.id;
      o.choice = c.index;
      o.tokens.assign(c.output.begin() + long(c.reported), c.output.end());
      o.logprobs = std::move(c.logprobs);
      c.logprobs.clear();
      c.reported = c.output.size();
      o.finish = c.finish;
      o.error = c.error;
      o.unschedulable = c.unschedulable;
      o.prompt_tokens = r.prompt_len();
      o.cached_tokens = r.cached_tokens;
      if (c.index == 0 && r.opts.prompt_logprobs >= 0 && !r.prompt_logprobs_reported &&
          int64_t(r.prompt_logprobs.size()) == r.prompt_len() - 1) {
        o.prompt_logprobs = std::move(r.prompt_logprobs);
        r.prompt_logprobs_reported = true;
      }
      c.finish_reported = c.finish != FinishReason::kNone;
      out.push_back(std::move(o));
    }
    if (r.finished() && !r.want_prompt_logits)
      it = requests_.erase(it);
    else
      ++it;
  }
}

std::vector<RequestOutput> EngineLoop::step() {
  if (!fatal_.empty()) throw EngineFailed(fatal_);
  try {
    return step_once();
  } catch (const EngineFailed& e) {
    fatal_ = e.what();
    throw;
  }
}

std::vector<RequestOutput> EngineLoop::step_once() {
  std::vector<RequestOutput> outputs;
  const std::vector<ScheduledChunk> chunks = sched_->schedule();
  if (chunks.empty()) {
    if (Request* r = sched_->blocked()) {
      const CacheUsage u = runner_->usage();
      fail_request(*r, cat("the request cannot be scheduled: the cache cannot hold it even with "
                           "nothing else running (",
                           r->prompt_len(), " prompt tokens, ", r->opts.max_new_tokens, " new, ",
                           r->choices.size(), " choice(s); ", u.pages_total[int(PageKind::kC4)],
                           " C4 and ", u.pages_total[int(PageKind::kC128)], " C128 pages of ",
                           runner_->page_size(), " entries, ", u.slots_total, " slots)"));
      for (Choice& c : r->choices) c.unschedulable = true;
    }
  } else {
    std::vector<StepInput> inputs(chunks.size());
    std::vector<SampleSpec> specs(chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      const ScheduledChunk& ch = chunks[i];
      Request& r = *ch.request;
      Choice& c = *ch.choice;
      StepInput& in = inputs[i];
      in.seq = c.seq;
      const int64_t P = r.prompt_len();
      for (int64_t p = ch.start; p < ch.start + ch.n - ch.drafts; ++p)
        in.tokens.push_back(p < P ? r.prompt[size_t(p)] : c.output[size_t(p - P)]);
      in.tokens.insert(in.tokens.end(), c.drafts.begin(), c.drafts.begin() + ch.drafts);
      in.verify = ch.drafts;
      in.logits = r.want_prompt_logits;
      in.all_logits = r.want_prompt_logits;
      if (r.scores_prompt(c)) {
        // Row p scores prompt token p + 1 (positions already collected are not re-scored
        // after a preemption).
        in.score.assign(size_t(ch.n), -1);
        for (int j = 0; j < ch.n; ++j) {
          const int64_t next = ch.start + j + 1;
          if (next < P && next > int64_t(r.prompt_logprobs.size()))
            in.score[size_t(j)] = r.prompt[size_t(next)];
        }
        in.score_top = r.opts.prompt_logprobs;
      }
      if (ch.sample) {
        SampleSpec& s = specs[i];
        s.params = &c.params;
        s.index = int64_t(c.output.size());
        s.counts = c.params.penalised() ? &c.counts : nullptr;
        const std::vector<int32_t>& forced = r.opts.forced_output;
        s.forced = size_t(s.index) < forced.size() ? forced[size_t(s.index)] : -1;
        s.forced_from = forced.empty() ? nullptr : &forced;
        s.draft_override = r.opts.forced_drafts.empty() ? nullptr : &r.opts.forced_drafts;
        in.sample = &s;
        // Drafts the next step can use: it emits at least one token first.
        in.draft = int(std::clamp<int64_t>(
            std::min<int64_t>({int64_t(drafts_of(r)), r.opts.max_new_tokens - s.index - 2,
                               opt_.max_tokens - P - s.index - 1}),
            0, kMaxDraftTokens));
      }
    }
    StepOutput out;
    bool ok = true;
    try {
      out = runner_->step(inputs);
    } catch (const EngineFailed&) {
      throw;  // not this batch's fault: nothing can run any more (step())
    } catch (const Error& e) {
      fail(chunks, e.what());
      ok = false;
    }
    if (ok) {
      postprocess(chunks, out);
      runner_->recycle(std::move(out));  // the next step's logits reuse its storage
    }
  }
  emit(outputs);
  return outputs;
}

EngineStats EngineLoop::stats() const {
  EngineStats s = counters_;
  s.running = 0;
  s.waiting = 0;
  for (const auto& [id, r] : requests_) {
    if (r->finished()) continue;
    bool any_seq = false;
    for (const Choice& c : r->choices) any_seq |= c.seq >= 0;
    (any_seq ? s.running : s.waiting) += 1;
  }
  // As vLLM counts it: what the snapshots alone hold is evictable, so free.
  std::vector<int> snapshots;
  for (const auto& p : prefix_)
    for (int seq : p->sequences()) snapshots.push_back(seq);
  s.cache_usage = runner_->usage_excluding(snapshots).fraction();
  s.preemptions = sched_->preemptions();
  s.prefix_queries = sched_->prefix_queries();
  s.prefix_hits = sched_->prefix_hits();
  return s;
}

bool EngineLoop::has_work() const {
  for (const auto& [id, r] : requests_)
    for (const Choice& c : r->choices)
      if (!c.finish_reported) return true;
  return false;
}

std::vector<float> EngineLoop::take_prompt_logits(uint64_t id) {
  auto it = requests_.find(id);
  DSV4_CHECK(it != requests_.end(), "unknown request ", id);
  Request& r = *it->second;
  DSV4_CHECK(r.finished(), "request ", id, " has not finished");
  for (const Choice& c : r.choices) DSV4_CHECK(c.finish != FinishReason::kError, c.error);
  std::vector<float> l = std::move(r.prompt_logits);
  requests_.erase(it);
  return l;
}

}  // namespace dsv4
