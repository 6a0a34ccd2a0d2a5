// One choice's output on its way to the client: token ids -> text (a UTF-8 character is never
// split; invalid bytes become U+FFFD) -> stop strings -> for chat, reasoning / content / DSML
// tool calls (the tokenizer's streaming parser, so markup is never content). Text after a stop
// string, and the tokens after the one that completed it, are dropped.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsv4/engine.h"
#include "server/stop_strings.h"
#include "tokenizer/chat_format.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/streaming_parser.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::server {

class ChoiceStream {
 public:
  struct Delta {
    std::string content;  // completions: the text
    std::string reasoning;
    std::vector<tok::ToolCall> tool_calls;
    std::vector<TokenLogprob> logprobs;  // of the tokens this delta consumed
    bool empty() const {
      return content.empty() && reasoning.empty() && tool_calls.empty() && logprobs.empty();
    }
  };

  // `chat_mode`: parse reasoning and tool calls (chat completions); nullopt: plain text.
  // `prefill`: text the prompt already wrote for the assistant (a tool-call block opening),
  // parsed before the first token.
  ChoiceStream(const tok::Tokenizer& tokenizer, std::vector<std::string> stop,
               std::optional<tok::chat::ThinkingMode> chat_mode, std::string_view prefill = {});

  // The tokens (and their logprobs, when asked) of one engine output.
  Delta push(const std::vector<int32_t>& tokens, const std::vector<TokenLogprob>& logprobs);
  // End of the choice: what was held back.
  Delta finish();

  bool stopped() const { return stop_.matched(); }  // a stop string matched
  int64_t tokens() const { return tokens_; }        // tokens counted (up to a stop string)
  // Text that failed to parse as reasoning / content / tool calls went out as content.
  bool malformed() const { return malformed_; }

 private:
  void route(std::string text, Delta& out);  // stop-filtered text -> parser -> out
  void parse_end(Delta& out);

  tok::StreamDecoder decoder_;
  StopStringMatcher stop_;
  std::optional<tok::StreamingCompletionParser> parser_;
  int64_t tokens_ = 0;
  bool malformed_ = false, finished_ = false;
};

}  // namespace dsv4::server
