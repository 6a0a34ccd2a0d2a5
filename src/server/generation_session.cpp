#include "server/generation_session.h"

#include <algorithm>

#include "core/error.h"
#include "server/api_error.h"

namespace dsv4::server {
namespace {

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

const char* finish_name(FinishReason r, bool tool_calls) {
  switch (r) {
    case FinishReason::kStop:
      return tool_calls ? "tool_calls" : "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    default:
      return "error";
  }
}

}  // namespace

GenerationSession::GenerationSession(ServerContext& ctx, GenerationRequest request, Api api)
    : ctx_(ctx),
      request_(std::move(request)),
      api_(api),
      tok_(*ctx.tokenizer),
      names_{ctx.tokenizer.get(), request_.tokens_as_ids},
      id_(random_id(api == Api::kChat ? "chatcmpl" : "cmpl")),
      created_(unix_time()) {
  ++ctx_.active_sessions;
  size_t total = 0;
  for (const Job& j : request_.jobs) total += size_t(j.n);
  choices_.reserve(total);
  for (size_t j = 0; j < request_.jobs.size(); ++j) {
    for (int i = 0; i < request_.jobs[j].n; ++i) {
      std::optional<tok::chat::ThinkingMode> mode;
      if (request_.chat) mode = request_.mode;
      choices_.emplace_back(int(j), int(choices_.size()),
                            ChoiceStream(tok_, request_.stop, mode, request_.prefill));
    }
    prompt_tokens_.push_back(int64_t(request_.jobs[j].prompt.size()));
  }
  cached_tokens_.assign(request_.jobs.size(), 0);
  prompt_logprobs_.resize(request_.jobs.size());
}

GenerationSession::~GenerationSession() {
  if (channel_ && !done_) {
    abort();  // the client went away
    for (const Choice& c : choices_)
      if (!c.done) ctx_.metrics.finished("abort");
  }
  --ctx_.active_sessions;
}

void GenerationSession::abort() {
  if (!channel_ || cancelled_) return;
  cancelled_ = true;
  ctx_.worker->cancel(channel_);
}

void GenerationSession::start() {
  channel_ = ctx_.worker->submit(request_.jobs);
  for (;;) {
    std::vector<ChannelEvent> events = channel_->wait(std::chrono::milliseconds(100));
    for (size_t i = 0; i < events.size(); ++i) {
      if (events[i].kind == ChannelEvent::kRefused) {
        channel_.reset();  // nothing runs
        throw ApiError(events[i].status, events[i].error);
      }
      if (events[i].kind == ChannelEvent::kAdmitted) {
        early_.assign(std::make_move_iterator(events.begin() + std::ptrdiff_t(i) + 1),
                      std::make_move_iterator(events.end()));
        if (!request_.stream) wait_first_output();
        return;
      }
    }
  }
}

void GenerationSession::wait_first_output() {
  for (;;) {
    for (const ChannelEvent& e : early_) {
      if (e.kind == ChannelEvent::kFailed) {
        done_ = true;  // nothing left to cancel
        throw ApiError(e.status, e.error);
      }
      if (e.kind == ChannelEvent::kOutput) {
        if (e.output.finish == FinishReason::kError)
          throw ApiError(e.output.unschedulable ? 400 : 500, e.output.error);
        return;  // (the destructor cancels the other jobs of a failed one)
      }
    }
    std::vector<ChannelEvent> more = channel_->wait(std::chrono::milliseconds(100));
    early_.insert(early_.end(), std::make_move_iterator(more.begin()),
                  std::make_move_iterator(more.end()));
  }
}

ordered_json GenerationSession::chunk(ordered_json choice) const {
  ordered_json j = {{"id", id_},
                    {"object", api_ == Api::kChat ? "chat.completion.chunk" : "text_completion"},
                    {"created", created_},
                    {"model", ctx_.model_name},
                    {"choices", ordered_json::array()}};
  if (!choice.is_null()) j["choices"].push_back(std::move(choice));
  if (request_.include_usage) j["usage"] = nullptr;
  return j;
}

void GenerationSession::echo(Choice& c, std::string& out) {
  c.echoed = true;
  if (!request_.echo) return;
  const std::vector<int32_t>& prompt = request_.jobs[size_t(c.job)].prompt;
  if (request_.logprobs >= 0) {
    c.completion_logprobs.add_unscored(names_, prompt[0]);
    for (const TokenLogprob& lp : prompt_logprobs_[size_t(c.job)])
      c.completion_logprobs.add(names_, lp);
  }
  const std::string& text = request_.prompt_text[size_t(c.job)];
  if (!request_.stream) {
    c.content += text;
    return;
  }
  ordered_json ch = {
      {"index", c.index},
      {"text", text},
      {"logprobs", request_.logprobs >= 0 ? c.completion_logprobs.take() : ordered_json(nullptr)},
      {"finish_reason", nullptr}};
  out += sse(chunk(std::move(ch)));
}

void GenerationSession::emit(Choice& c, ChoiceStream::Delta& d, const std::string& finish,
                             std::string& out) {
  for (size_t k = 0; k < d.tool_calls.size(); ++k) c.call_ids.push_back(random_id("call_"));
  if (api_ == Api::kCompletions)
    for (const TokenLogprob& lp : d.logprobs) c.completion_logprobs.add(names_, lp);
  if (!request_.stream) {
    c.content += d.content;
    c.reasoning += d.reasoning;
    c.calls.insert(c.calls.end(), d.tool_calls.begin(), d.tool_calls.end());
    c.logprobs.insert(c.logprobs.end(), d.logprobs.begin(), d.logprobs.end());
    return;
  }
  const bool want_logprobs =
      api_ == Api::kChat ? request_.jobs[0].sampling.logprobs : request_.logprobs >= 0;
  if (api_ == Api::kCompletions) {
    if (!d.content.empty() || !d.logprobs.empty() || !finish.empty()) {
      ordered_json ch = {
          {"index", c.index},
          {"text", d.content},
          {"logprobs", want_logprobs && !d.logprobs.empty() ? c.completion_logprobs.take()
                                                            : ordered_json(nullptr)},
          {"finish_reason", finish.empty() ? ordered_json(nullptr) : ordered_json(finish)}};
      out += sse(chunk(std::move(ch)));
    }
    return;
  }
  // Chat: reasoning, then content (with the logprobs of the tokens this step brought), then
  // each tool call (a name delta, then its arguments), then the finish.
  auto delta_chunk = [&](ordered_json delta, const std::vector<TokenLogprob>* lps) {
    ordered_json ch = {{"index", c.index}, {"delta", std::move(delta)}};
    ch["logprobs"] = lps && want_logprobs ? ordered_json{{"content", chat_logprobs(names_, *lps)}}
                                          : ordered_json(nullptr);
    ch["finish_reason"] = nullptr;
    out += sse(chunk(std::move(ch)));
  };
  const std::vector<TokenLogprob>* lps = d.logprobs.empty() ? nullptr : &d.logprobs;
  if (!d.reasoning.empty()) {
    delta_chunk({{"reasoning_content", d.reasoning}, {"reasoning", d.reasoning}}, lps);
    lps = nullptr;
  }
  if (!d.content.empty() || lps) {
    delta_chunk({{"content", d.content}}, lps);
    lps = nullptr;
  }
  for (const tok::ToolCall& call : d.tool_calls) {
    const int k = int(c.calls.size());
    const std::string& id = c.call_ids[size_t(k)];
    delta_chunk({{"tool_calls",
                  {{{"index", k},
                    {"id", id},
                    {"type", "function"},
                    {"function", {{"name", call.name}, {"arguments", ""}}}}}}},
                nullptr);
    delta_chunk({{"tool_calls", {{{"index", k}, {"function", {{"arguments", call.arguments}}}}}}},
                nullptr);
    c.calls.push_back(call);
  }
  if (!finish.empty()) {
    ordered_json ch = {{"index", c.index},
                       {"delta", ordered_json::object()},
                       {"logprobs", nullptr},
                       {"finish_reason", finish}};
    out += sse(chunk(std::move(ch)));
  }
}

void GenerationSession::output(Choice& c, const RequestOutput& o, Clock::time_point t,
                               std::string& out) {
  const bool engine_finished = o.finish != FinishReason::kNone;
  if (engine_finished) c.engine_done = true;
  cached_tokens_[size_t(c.job)] = std::max(cached_tokens_[size_t(c.job)], o.cached_tokens);
  if (!o.prompt_logprobs.empty()) prompt_logprobs_[size_t(c.job)] = o.prompt_logprobs;
  if (c.done) return;  // ended on a stop string; the engine's rest is dropped
  if (!c.echoed) echo(c, out);
  if (!o.tokens.empty()) {
    if (!first_token_) {
      first_token_ = true;
      ctx_.metrics.time_to_first_token(seconds(t - channel_->arrival()));
    }
    if (c.any_token) ctx_.metrics.inter_token_latency(seconds(t - c.last_token));
    c.any_token = true;
    c.last_token = t;
  }
  ChoiceStream::Delta d = c.text.push(o.tokens, o.logprobs);
  std::string finish;
  if (c.text.stopped()) {
    finish = "stop";
  } else if (engine_finished) {
    ChoiceStream::Delta rest = c.text.finish();
    d.content += rest.content;
    d.reasoning += rest.reasoning;
    d.tool_calls.insert(d.tool_calls.end(), rest.tool_calls.begin(), rest.tool_calls.end());
    const bool calls = !c.calls.empty() || !d.tool_calls.empty();
    finish = finish_name(o.finish, calls && request_.chat);
    if (o.finish == FinishReason::kError && error_.empty()) error_ = o.error;
  }
  if (!finish.empty() && finish == "stop" && request_.chat &&
      (!c.calls.empty() || !d.tool_calls.empty()))
    finish = "tool_calls";
  emit(c, d, finish, out);
  if (!finish.empty()) {
    c.done = true;
    c.finish = finish;
    ctx_.metrics.finished(finish);
  }
}

void GenerationSession::handle(ChannelEvent& e, std::string& out) {
  if (e.kind == ChannelEvent::kOutput) {
    const size_t base = size_t(std::count_if(choices_.begin(), choices_.end(),
                                             [&](const Choice& c) { return c.job < e.job; }));
    const size_t i = base + size_t(e.output.choice);
    if (i < choices_.size()) output(choices_[i], e.output, e.time, out);
  } else if (e.kind == ChannelEvent::kFailed) {
    if (error_.empty()) error_ = e.error, error_status_ = e.status;
    for (Choice& c : choices_) {
      c.engine_done = true;
      if (c.done) continue;
      ChoiceStream::Delta d;
      emit(c, d, "error", out);
      c.done = true;
      c.finish = "error";
      ctx_.metrics.finished("error");
    }
  }
}

void GenerationSession::finish_all(std::string& out) {
  done_ = true;
  ctx_.metrics.e2e_request_latency(seconds(Clock::now() - channel_->arrival()));
  // Choices that ended on stop strings leave engine work behind: free it now.
  if (std::any_of(choices_.begin(), choices_.end(), [](const Choice& c) { return !c.engine_done; }))
    abort();
  if (!request_.stream) {
    if (error_.empty()) out += final_body();
    return;
  }
  if (!error_.empty()) out += "data: " + error_body(error_status_, error_) + "\n\n";
  if (request_.include_usage) {
    int64_t completion = 0, prompt = 0, cached = 0;
    for (const Choice& c : choices_) completion += c.text.tokens();
    for (size_t j = 0; j < prompt_tokens_.size(); ++j)
      prompt += prompt_tokens_[j], cached += cached_tokens_[j];
    ordered_json j = chunk(nullptr);
    j["usage"] = usage_json(prompt, completion, cached);
    out += sse(j);
  }
  out += "data: [DONE]\n\n";
}

std::string GenerationSession::final_body() {
  int64_t completion = 0, prompt = 0, cached = 0;
  for (const Choice& c : choices_) completion += c.text.tokens();
  for (size_t j = 0; j < prompt_tokens_.size(); ++j)
    prompt += prompt_tokens_[j], cached += cached_tokens_[j];
  ordered_json choices = ordered_json::array();
  for (Choice& c : choices_) {
    ordered_json ch = {{"index", c.index}};
    if (api_ == Api::kChat) {
      ordered_json m = {{"role", "assistant"}};
      m["content"] =
          c.content.empty() && !c.calls.empty() ? ordered_json(nullptr) : ordered_json(c.content);
      const bool thinking = request_.mode == tok::chat::ThinkingMode::kThinking;
      m["reasoning_content"] = thinking ? ordered_json(c.reasoning) : ordered_json(nullptr);
      m["reasoning"] = m["reasoning_content"];
      if (!c.calls.empty()) {
        ordered_json calls = ordered_json::array();
        for (size_t k = 0; k < c.calls.size(); ++k)
          calls.push_back(tool_call_json(c.calls[k], c.call_ids[k]));
        m["tool_calls"] = std::move(calls);
      }
      ch["message"] = std::move(m);
      ch["logprobs"] = request_.jobs[0].sampling.logprobs
                           ? ordered_json{{"content", chat_logprobs(names_, c.logprobs)}}
                           : ordered_json(nullptr);
    } else {
      ch["text"] = c.content;
      ch["logprobs"] =
          request_.logprobs >= 0 ? c.completion_logprobs.take() : ordered_json(nullptr);
    }
    ch["finish_reason"] = c.finish;
    choices.push_back(std::move(ch));
  }
  ordered_json j = {{"id", id_},
                    {"object", api_ == Api::kChat ? "chat.completion" : "text_completion"},
                    {"created", created_},
                    {"model", ctx_.model_name},
                    {"choices", std::move(choices)},
                    {"usage", usage_json(prompt, completion, cached)}};
  return to_text(j);
}

std::string GenerationSession::poll(std::chrono::milliseconds timeout) {
  std::string out;
  if (done_) return out;
  if (!began_) {
    began_ = true;
    if (request_.stream && api_ == Api::kChat)
      for (const Choice& c : choices_) {
        ordered_json ch = {{"index", c.index},
                           {"delta", {{"role", "assistant"}, {"content", ""}}},
                           {"logprobs", nullptr},
                           {"finish_reason", nullptr}};
        out += sse(chunk(std::move(ch)));
      }
  }
  std::vector<ChannelEvent> events = std::move(early_);
  early_.clear();
  if (events.empty()) events = channel_->wait(timeout);
  for (ChannelEvent& e : events) handle(e, out);
  if (std::all_of(choices_.begin(), choices_.end(), [](const Choice& c) { return c.done; }))
    finish_all(out);
  return out;
}

}  // namespace dsv4::server
