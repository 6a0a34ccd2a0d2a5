// DeepSeek-V4's prompt format: OpenAI-style messages -> the prompt text, byte-identical to the
// official first-release encoder (encoding_dsv4.py, encode_messages). See
// ../shared/spec/encoding_dsv4.md for the rules; in short:
// * roles system, developer, user, assistant, tool, latest_reminder; tools and response_format
//   on system/developer; tool messages become <tool_result> blocks of a user turn, ordered as
//   the preceding assistant's tool_calls; adjacent user turns merge;
// * "thinking" mode drops reasoning (and developer messages) before the last user turn, unless
//   any message has tools; assistant `wo_eos` leaves the EOS off (prefill); `task` appends a
//   task token; `context` messages count for these rules but are not written again;
// * reasoning effort follows the first release's table: "max" (thinking mode) writes a preamble
//   at the start, "high" and none write nothing.
// The tokenizer then maps the control-token strings in the text to their ids.
#pragma once

#include <optional>
#include <string>

#include "tokenizer/chat_format.h"
#include "tokenizer/python_json.h"

namespace dsv4::tok {

struct EncodeOptions {
  chat::ThinkingMode mode = chat::ThinkingMode::kChat;
  std::optional<std::string> reasoning_effort;  // nullopt, "high" or "max"
  bool drop_thinking = true;
  bool add_bos = true;
  ordered_json context = ordered_json::array();  // messages already in the model's cache
};

// The prompt for `messages` (a JSON list of message objects). Throws dsv4::Error with a one-line
// reason for input the official encoder rejects (unknown role or task, empty developer message,
// a bad reasoning effort, malformed tools or tool_calls, non-text content).
std::string encode_messages(const ordered_json& messages, const EncodeOptions& options = {});

// "high" / "max" / nullopt from a user-facing name ("none" or "" mean nullopt); throws for
// anything else, listing the accepted names.
std::optional<std::string> parse_reasoning_effort(const std::string& name);

}  // namespace dsv4::tok
