// One chat-completions or completions request from admission to its last byte: queues the jobs
// on the engine loop, turns every engine output into text per choice (ChoiceStream), records
// the latency metrics, and writes the response: SSE chunks as they come when streaming, else
// the whole JSON body at the end. Choices that stop on a stop string end there; the engine
// work left is cancelled as soon as every choice has ended, and when the client goes away.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "server/choice_stream.h"
#include "server/generation_request.h"
#include "server/openai_format.h"
#include "server/request_channel.h"
#include "server/server_context.h"

namespace dsv4::server {

class GenerationSession {
 public:
  enum class Api { kChat, kCompletions };

  GenerationSession(ServerContext& ctx, GenerationRequest request, Api api);
  ~GenerationSession();
  GenerationSession(const GenerationSession&) = delete;
  GenerationSession& operator=(const GenerationSession&) = delete;

  // Queues the request and waits until the engine has admitted it. Throws ApiError: 429, 503,
  // or 400 with the engine's reason when it refuses the request. A non-streaming request also
  // waits for its first output, so that a failure before it still gets its own status (a
  // client that goes away is noticed from then on).
  void start();

  // Waits up to `timeout` for engine output; returns the response text now due: SSE events
  // when streaming, else the whole body once done (empty until then).
  std::string poll(std::chrono::milliseconds timeout);
  bool done() const { return done_; }
  // Non-streaming: the engine failed after admission (the body cannot say so; the caller drops
  // the connection).
  bool failed() const { return !error_.empty() && !request_.stream; }
  // The client went away: cancel the engine work.
  void abort();
  const char* content_type() const {
    return request_.stream ? "text/event-stream" : "application/json";
  }

 private:
  struct Choice {
    Choice(int j, int i, ChoiceStream t) : job(j), index(i), text(std::move(t)) {}
    int job = 0, index = 0;
    ChoiceStream text;
    bool done = false, engine_done = false, echoed = false;
    std::string finish;
    // Non-streaming accumulation.
    std::string content, reasoning;
    std::vector<tok::ToolCall> calls;
    std::vector<std::string> call_ids;
    std::vector<TokenLogprob> logprobs;
    CompletionLogprobs completion_logprobs;
    Clock::time_point last_token;
    bool any_token = false;
  };

  void wait_first_output();
  void handle(ChannelEvent& e, std::string& out);
  void output(Choice& c, const RequestOutput& o, Clock::time_point t, std::string& out);
  void emit(Choice& c, ChoiceStream::Delta& d, const std::string& finish, std::string& out);
  void echo(Choice& c, std::string& out);
  void finish_all(std::string& out);
  std::string final_body();
  ordered_json chunk(ordered_json choice) const;
  std::string sse(const ordered_json& j) const { return "data: " + to_text(j) + "\n\n"; }

  ServerContext& ctx_;
  const GenerationRequest request_;
  const Api api_;
  const tok::Tokenizer& tok_;
  const TokenNames names_;
  std::shared_ptr<RequestChannel> channel_;
  std::vector<ChannelEvent> early_;  // outputs that came with the admission
  std::vector<Choice> choices_;
  std::vector<int64_t> prompt_tokens_, cached_tokens_;
  std::vector<std::vector<TokenLogprob>> prompt_logprobs_;  // per job (completions echo)
  std::string id_;
  int64_t created_ = 0;
  bool began_ = false, done_ = false, first_token_ = false, cancelled_ = false;
  std::string error_;
  int error_status_ = 500;
};

}  // namespace dsv4::server
