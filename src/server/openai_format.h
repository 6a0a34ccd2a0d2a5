// The JSON pieces of OpenAI responses: ids, usage, logprobs in the chat and the completions
// layouts, tool calls. Text is valid UTF-8 by construction (invalid bytes became U+FFFD).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsv4/engine.h"
#include "tokenizer/dsml.h"
#include "tokenizer/python_json.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::server {

using tok::ordered_json;

// "<prefix>-<24 hex digits>", e.g. chatcmpl-..., cmpl-...; call_... for tool calls.
std::string random_id(const std::string& prefix);
int64_t unix_time();

// JSON text of one response or chunk (one line).
std::string to_text(const ordered_json& j);

ordered_json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

// How logprobs name tokens: the text a token stands for (a partial UTF-8 character shows as
// U+FFFD), or "token_id:N" (vLLM's return_tokens_as_token_ids).
struct TokenNames {
  const tok::Tokenizer* tokenizer = nullptr;
  bool as_ids = false;
  std::string operator()(int32_t id) const;
};

// Chat: {"token", "logprob", "bytes", "top_logprobs": [...]} per token.
ordered_json chat_logprobs(const TokenNames& names, const std::vector<TokenLogprob>& lps);

// Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, built up in order.
class CompletionLogprobs {
 public:
  // A prompt token without a logprob (the first one of an echo).
  void add_unscored(const TokenNames& names, int32_t id);
  void add(const TokenNames& names, const TokenLogprob& lp);
  // Entries added since the last take (for a streamed chunk); offsets keep counting.
  ordered_json take();
  bool empty() const { return tokens_.empty(); }

 private:
  void push(const std::string& text);
  ordered_json tokens_ = ordered_json::array(), logprobs_ = ordered_json::array(),
               top_ = ordered_json::array(), offsets_ = ordered_json::array();
  int64_t offset_ = 0;  // in code points, as Python counts
};

// {"id", "type": "function", "function": {"name", "arguments"}}.
ordered_json tool_call_json(const tok::ToolCall& call, const std::string& id);

}  // namespace dsv4::server
