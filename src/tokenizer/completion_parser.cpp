#include "tokenizer/completion_parser.h"

#include "core/error.h"
#include "tokenizer/read_until.h"

namespace dsv4::tok {

ordered_json ParsedCompletion::to_json() const {
  ordered_json calls = ordered_json::array();
  for (const ToolCall& c : tool_calls)
    calls.push_back(
        {{"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
  return {{"role", "assistant"},
          {"content", content},
          {"reasoning_content", reasoning_content},
          {"tool_calls", calls}};
}

void check_no_control_tokens(std::string_view text, const char* what) {
  for (std::string_view t :
       {chat::kBos, chat::kEos, chat::kThinkStart, chat::kThinkEnd, chat::kDsml})
    DSV4_CHECK(text.find(t) == std::string_view::npos, "completion: ", what, " contains ", t);
}

ParsedCompletion parse_completion(std::string_view text, chat::ThinkingMode mode) {
  ParsedCompletion out;
  size_t index = 0;
  if (mode == chat::ThinkingMode::kThinking) {
    const ReadResult r = read_until(text, 0, {chat::kThinkEnd, chat::kToolCallsStart}, true);
    DSV4_CHECK(r.stop == 0, "completion: the reasoning is not closed by </think>");
    out.reasoning_content = r.content;
    index = r.next;
  }
  ReadResult r = read_until(text, index, {chat::kEos, chat::kToolCallsStart}, true);
  out.content = r.content;
  index = r.next;
  DSV4_CHECK(r.stop >= 0, "completion: no EOS (", chat::kEos, ") at the end");
  if (r.stop == 1) {
    DsmlBlockReader reader;
    reader.advance(text.substr(index), true, out.tool_calls);
    index += reader.end();
    r = read_until(text, index, {chat::kEos}, true);
    DSV4_CHECK(r.content.empty(), "completion: unexpected text after the tool calls");
    index = r.next;
  }
  DSV4_CHECK(index == text.size(), "completion: unexpected text after EOS");
  check_no_control_tokens(out.content, "the content");
  check_no_control_tokens(out.reasoning_content, "the reasoning");
  return out;
}

}  // namespace dsv4::tok
