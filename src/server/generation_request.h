// Parsing /v1/chat/completions and /v1/completions bodies into engine jobs plus what the
// response needs (stop strings, streaming, logprobs, the chat parser's mode). Every field is
// checked here or by Engine::add_request; a bad one is an ApiError (400, 404 for the model).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "dsv4/engine.h"
#include "server/json_fields.h"
#include "server/request_channel.h"
#include "tokenizer/chat_format.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::server {

// What parsing needs to know about the server.
struct ParseContext {
  const tok::Tokenizer* tokenizer = nullptr;
  ModelInfo info;
  std::string served_model_name;
  bool forced_output_enabled = false;  // the test facility (--test-forced-output)
  // Sampling defaults (the model's generation_config.json, else OpenAI's).
  double temperature = 1.0, top_p = 1.0;
  int top_k = 0;
};

struct GenerationRequest {
  std::vector<Job> jobs;  // chat: one; completions: one per prompt
  bool stream = false, include_usage = false;
  std::vector<std::string> stop;
  bool tokens_as_ids = false;  // return_tokens_as_token_ids (vLLM): logprobs name "token_id:N"
  // Chat: the parser's mode and the text the prompt already wrote for the assistant (the
  // opening of a tool-call block for tool_choice "required" or a named tool).
  bool chat = false;
  tok::chat::ThinkingMode mode = tok::chat::ThinkingMode::kChat;
  std::string prefill;
  bool tools = false;  // tools were given (finish_reason "tool_calls" applies)
  // Completions: echo the prompt (its text per job) and logprobs with this many alternatives.
  bool echo = false;
  int logprobs = -1;  // completions: -1 off
  std::vector<std::string> prompt_text;
};

// messages (+ tools, tool_choice, response_format, thinking switches) -> the prompt text as the
// DeepSeek-V4 encoder writes it. Shared by chat completions and /tokenize.
struct ChatPrompt {
  std::string text;
  tok::chat::ThinkingMode mode = tok::chat::ThinkingMode::kChat;
  std::string prefill;  // already at the end of text
  bool tools = false;
};
ChatPrompt render_chat_prompt(const ordered_json& body, bool add_bos = true);

// 404 unless body.model (when given) is the served model.
void check_model(const ordered_json& body, const std::string& served_model_name);

GenerationRequest parse_chat_request(const ordered_json& body, const ParseContext& ctx);
GenerationRequest parse_completion_request(const ordered_json& body, const ParseContext& ctx);

}  // namespace dsv4::server
