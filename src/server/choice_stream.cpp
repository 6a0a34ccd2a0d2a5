#include "server/choice_stream.h"

#include <cstdio>

#include "core/error.h"

namespace dsv4::server {

ChoiceStream::ChoiceStream(const tok::Tokenizer& tokenizer, std::vector<std::string> stop,
                           std::optional<tok::chat::ThinkingMode> chat_mode,
                           std::string_view prefill)
    // Special tokens (BOS, EOS, padding) are not text; <think>, </think> and the DSML tokens
    // are not special, so the parser sees them.
    : decoder_(tokenizer, /*skip_special=*/true), stop_(std::move(stop)) {
  if (chat_mode) parser_.emplace(*chat_mode);
  if (!prefill.empty()) {
    Delta ignored;  // the prefill opens a tool-call block: nothing of it is content
    route(std::string(prefill), ignored);
  }
}

void ChoiceStream::route(std::string text, Delta& out) {
  if (text.empty()) return;
  if (!parser_ || malformed_) {
    out.content += text;
    return;
  }
  const tok::ParsedCompletion& r = parser_->result();
  const size_t content0 = r.content.size(), reasoning0 = r.reasoning_content.size(),
               calls0 = r.tool_calls.size();
  try {
    tok::StreamingCompletionParser::Delta d = parser_->feed(text);
    out.content += d.content;
    out.reasoning += d.reasoning;
    out.tool_calls.insert(out.tool_calls.end(), d.tool_calls.begin(), d.tool_calls.end());
  } catch (const Error& e) {
    // Malformed output (a stray <think> or DSML tag, a broken tool call): passed on as the
    // model wrote it, as content, rather than lost.
    out.reasoning += r.reasoning_content.substr(reasoning0);
    out.content += r.content.substr(content0);
    out.tool_calls.insert(out.tool_calls.end(), r.tool_calls.begin() + std::ptrdiff_t(calls0),
                          r.tool_calls.end());
    out.content += parser_->abandon();
    malformed_ = true;
    std::fprintf(stderr, "dsv4 serve: warning: %s; the rest of the choice is plain content\n",
                 e.what());
  }
}

ChoiceStream::Delta ChoiceStream::push(const std::vector<int32_t>& tokens,
                                       const std::vector<TokenLogprob>& logprobs) {
  Delta out;
  for (size_t i = 0; i < tokens.size() && !stop_.matched(); ++i) {
    ++tokens_;
    if (i < logprobs.size()) out.logprobs.push_back(logprobs[i]);
    route(stop_.push(decoder_.push(tokens[i])), out);
  }
  if (stop_.matched()) parse_end(out);
  return out;
}

void ChoiceStream::parse_end(Delta& out) {
  if (finished_) return;
  finished_ = true;
  if (parser_ && !malformed_) {
    tok::StreamingCompletionParser::Delta d = parser_->finish_truncated();
    out.content += d.content;
    out.reasoning += d.reasoning;
    out.tool_calls.insert(out.tool_calls.end(), d.tool_calls.begin(), d.tool_calls.end());
  }
}

ChoiceStream::Delta ChoiceStream::finish() {
  Delta out;
  if (!stop_.matched()) {
    route(stop_.push(decoder_.finish()), out);
    route(stop_.flush(), out);
  }
  parse_end(out);
  return out;
}

}  // namespace dsv4::server
