// Parsing what the model wrote after the prompt (up to and including EOS) into an assistant
// message: reasoning (thinking mode: the text before </think>), content (up to EOS or the DSML
// block) and tool calls. Accepts and rejects exactly what the official
// parse_message_from_completion_text does.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/chat_format.h"
#include "tokenizer/dsml.h"
#include "tokenizer/python_json.h"

namespace dsv4::tok {

struct ParsedCompletion {
  std::string content, reasoning_content;
  std::vector<ToolCall> tool_calls;

  // {"role": "assistant", "content", "reasoning_content", "tool_calls": [{"type": "function",
  // "function": {"name", "arguments"}}]}, the official parser's result.
  ordered_json to_json() const;
  bool operator==(const ParsedCompletion&) const = default;
};

// Throws dsv4::Error with the reason when the text is not a well-formed completion.
ParsedCompletion parse_completion(std::string_view text, chat::ThinkingMode mode);

// Throws if `text` (content or reasoning) holds BOS, EOS, <think>, </think> or ｜DSML｜.
void check_no_control_tokens(std::string_view text, const char* what);

}  // namespace dsv4::tok
