// Incremental parsing of a completion while it is generated: reasoning and content are
// returned as soon as they are known not to be part of a control tag. Only a tail that could
// still become a tag (the longest suffix that is a proper prefix of </think>, EOS, the DSML
// block start "\n\n<｜DSML｜tool_calls", BOS, <think> or ｜DSML｜) is held back, so DSML markup
// is never returned as content; tool calls are returned whole, each when its invoke closes.
// Fed in any pieces, the concatenated output equals parse_completion() of the whole text, and
// malformed text raises the same kind of dsv4::Error (at the latest from finish()).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/chat_format.h"
#include "tokenizer/completion_parser.h"
#include "tokenizer/dsml.h"

namespace dsv4::tok {

class StreamingCompletionParser {
 public:
  struct Delta {
    std::string reasoning, content;
    std::vector<ToolCall> tool_calls;
    bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
  };

  explicit StreamingCompletionParser(chat::ThinkingMode mode);

  // The newly decided part of the output. Throws dsv4::Error on malformed text.
  Delta feed(std::string_view text);
  // End of the completion: returns what is left and checks the completion was complete.
  Delta finish();
  // End of a completion cut short (a length limit or a stop string, no EOS): the held-back
  // reasoning or content is returned as it stands (a partial tag is text then); inside a
  // tool-call block only the calls already complete count, an unfinished one is dropped.
  Delta finish_truncated();
  // After feed() threw: the text fed and not returned yet, as written (a rejected tag
  // included; inside a tool-call block, what follows the last returned call, or the whole block
  // with its start marker when none was returned), for a caller that passes malformed output on
  // as plain text. Nothing is returned from then on.
  std::string abandon();

  // Everything returned so far.
  const ParsedCompletion& result() const { return result_; }
  // Whether EOS has been read (nothing may follow it).
  bool ended() const { return phase_ == Phase::kEnded; }

 private:
  enum class Phase { kReasoning, kContent, kToolCalls, kAfterToolCalls, kEnded };

  void scan_text(Delta& out);  // reasoning / content phases
  void scan_tool_calls(bool final, Delta& out);
  void check_after_tool_calls(bool final);
  void emit(std::string_view text, Delta& out);

  Phase phase_;
  std::string pending_;  // unread text of the current phase
  DsmlBlockReader reader_;
  ParsedCompletion result_;
};

}  // namespace dsv4::tok
