// DSML, DeepSeek-V4's tool-call markup: writing the block for an assistant message's OpenAI-style
// tool_calls, and reading the block a model writes back into (name, JSON arguments) pairs with
// the same acceptance rules as the official parser.
//
//   \n\n<｜DSML｜tool_calls>
//   <｜DSML｜invoke name="NAME">
//   <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
//   </｜DSML｜invoke>
//   </｜DSML｜tool_calls>
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/python_json.h"

namespace dsv4::tok {

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object as text
  bool operator==(const ToolCall&) const = default;
};

// The block (starting with its "\n\n") for `tool_calls`: [{function: {name, arguments}}, ...],
// arguments a JSON string (a non-JSON or non-string one becomes a single "arguments" parameter,
// as the official encoder does). Throws dsv4::Error on malformed entries.
std::string render_dsml_tool_calls(const ordered_json& tool_calls);

// Reads the text after "\n\n<｜DSML｜tool_calls" (chat::kToolCallsStart). Resumable: call
// advance() again when more text has arrived; only complete invokes are returned, each once.
class DsmlBlockReader {
 public:
  enum class Status {
    kNeedMore,  // not final, the next invoke or the closing tag is not complete yet
    kClosed,    // read through </｜DSML｜tool_calls>; end() is where what follows begins
    kEnded,     // final text ended without the closing tag in a way the official parser accepts
  };

  // `text`: everything after the start marker so far (each call sees a longer text). `final`:
  // no more text will come. Appends newly completed calls. Throws dsv4::Error on bad syntax.
  Status advance(std::string_view text, bool final, std::vector<ToolCall>& calls);
  size_t end() const { return pos_; }

 private:
  size_t pos_ = 0;  // start of the next unread ">\n" + invoke (or closing tag)
};

}  // namespace dsv4::tok
