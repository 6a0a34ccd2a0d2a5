#include "tokenizer/streaming_parser.h"

#include <algorithm>
#include <array>

#include "core/error.h"

namespace dsv4::tok {
namespace {

enum class Action { kEndReasoning, kEndContent, kStartToolCalls, kReject };

struct Marker {
  std::string_view text;
  Action action;
};

// Tags that end or break the current phase. A tag found in the text is acted on; the official
// parser rejects every kReject tag inside reasoning or content, so failing on sight is the
// same outcome, reached before any of it is returned.
constexpr std::array<Marker, 6> kReasoningMarkers = {{
    {chat::kThinkEnd, Action::kEndReasoning},
    {chat::kToolCallsStart, Action::kReject},  // tool calls before </think>
    {chat::kBos, Action::kReject},
    {chat::kEos, Action::kReject},
    {chat::kThinkStart, Action::kReject},
    {chat::kDsml, Action::kReject},
}};
constexpr std::array<Marker, 6> kContentMarkers = {{
    {chat::kEos, Action::kEndContent},
    {chat::kToolCallsStart, Action::kStartToolCalls},
    {chat::kBos, Action::kReject},
    {chat::kThinkStart, Action::kReject},
    {chat::kThinkEnd, Action::kReject},
    {chat::kDsml, Action::kReject},
}};

}  // namespace

StreamingCompletionParser::StreamingCompletionParser(chat::ThinkingMode mode)
    : phase_(mode == chat::ThinkingMode::kThinking ? Phase::kReasoning : Phase::kContent) {}

void StreamingCompletionParser::emit(std::string_view text, Delta& out) {
  if (text.empty()) return;
  if (phase_ == Phase::kReasoning) {
    out.reasoning += text;
    result_.reasoning_content += text;
  } else {
    out.content += text;
    result_.content += text;
  }
}

void StreamingCompletionParser::scan_text(Delta& out) {
  while (phase_ == Phase::kReasoning || phase_ == Phase::kContent) {
    const auto& markers = phase_ == Phase::kReasoning ? kReasoningMarkers : kContentMarkers;
    // The earliest complete tag, and the earliest place from which the rest of the text is a
    // proper prefix of a tag (it may still become one).
    size_t found_at = std::string::npos, longest = 0;
    const Marker* found = nullptr;
    for (const Marker& m : markers) {
      const size_t p = pending_.find(m.text);
      if (p < found_at) {
        found_at = p;
        found = &m;
      }
      longest = std::max(longest, m.text.size());
    }
    size_t hold = pending_.size();
    for (size_t q = pending_.size() > longest ? pending_.size() - longest : 0;
         q < pending_.size() && hold == pending_.size(); ++q) {
      const std::string_view rest = std::string_view(pending_).substr(q);
      for (const Marker& m : markers)
        if (rest.size() < m.text.size() && m.text.substr(0, rest.size()) == rest) hold = q;
    }
    if (!found || found_at >= hold) {
      emit(std::string_view(pending_).substr(0, hold), out);
      pending_.erase(0, hold);
      return;
    }
    emit(std::string_view(pending_).substr(0, found_at), out);
    // A rejected tag stays unread (abandon() returns it).
    pending_.erase(0, found_at + (found->action == Action::kReject ? 0 : found->text.size()));
    switch (found->action) {
      case Action::kEndReasoning:
        phase_ = Phase::kContent;
        break;
      case Action::kEndContent:
        phase_ = Phase::kEnded;
        DSV4_CHECK(pending_.empty(), "completion: unexpected text after EOS");
        return;
      case Action::kStartToolCalls:
        phase_ = Phase::kToolCalls;
        return;
      case Action::kReject:
        if (phase_ == Phase::kReasoning && found->text == chat::kToolCallsStart)
          throw Error("completion: the reasoning is not closed by </think>");
        throw Error(
            cat("completion: ", phase_ == Phase::kReasoning ? "the reasoning" : "the content",
                " contains ", found->text));
    }
  }
}

void StreamingCompletionParser::check_after_tool_calls(bool final) {
  // Only EOS (or, at the very end, nothing) may follow the block.
  if (pending_ == chat::kEos) {
    pending_.clear();
    phase_ = Phase::kEnded;
    return;
  }
  const bool maybe_eos =
      pending_.size() < chat::kEos.size() && chat::kEos.substr(0, pending_.size()) == pending_;
  DSV4_CHECK(maybe_eos && (!final || pending_.empty()),
             "completion: unexpected text after the tool calls");
  if (final) phase_ = Phase::kEnded;
}

void StreamingCompletionParser::scan_tool_calls(bool final, Delta& out) {
  const size_t before = result_.tool_calls.size();
  const DsmlBlockReader::Status st = reader_.advance(pending_, final, result_.tool_calls);
  out.tool_calls.insert(out.tool_calls.end(), result_.tool_calls.begin() + std::ptrdiff_t(before),
                        result_.tool_calls.end());
  if (st == DsmlBlockReader::Status::kClosed) {
    pending_.erase(0, reader_.end());
    phase_ = Phase::kAfterToolCalls;
    check_after_tool_calls(final);
  } else if (st == DsmlBlockReader::Status::kEnded) {
    pending_.clear();
    phase_ = Phase::kEnded;
  }
}

StreamingCompletionParser::Delta StreamingCompletionParser::feed(std::string_view text) {
  Delta out;
  if (text.empty()) return out;
  DSV4_CHECK(phase_ != Phase::kEnded, "completion: unexpected text after EOS");
  pending_ += text;
  scan_text(out);
  if (phase_ == Phase::kToolCalls)
    scan_tool_calls(false, out);
  else if (phase_ == Phase::kAfterToolCalls)
    check_after_tool_calls(false);
  return out;
}

StreamingCompletionParser::Delta StreamingCompletionParser::finish() {
  Delta out;
  switch (phase_) {
    case Phase::kReasoning:
      throw Error("completion: the reasoning is not closed by </think>");
    case Phase::kContent:
      throw Error(cat("completion: no EOS (", chat::kEos, ") at the end"));
    case Phase::kToolCalls:
      scan_tool_calls(true, out);
      break;
    case Phase::kAfterToolCalls:
      check_after_tool_calls(true);
      break;
    case Phase::kEnded:
      break;
  }
  return out;
}

StreamingCompletionParser::Delta StreamingCompletionParser::finish_truncated() {
  Delta out;
  if (phase_ == Phase::kReasoning || phase_ == Phase::kContent) emit(pending_, out);
  if (phase_ == Phase::kToolCalls) {
    // The calls complete by now (the official parser accepts a block that ends right after
    // an invoke); an unfinished one is dropped.
    const size_t before = result_.tool_calls.size();
    try {
      reader_.advance(pending_, true, result_.tool_calls);
    } catch (const Error&) {
    }
    out.tool_calls.insert(out.tool_calls.end(), result_.tool_calls.begin() + std::ptrdiff_t(before),
                          result_.tool_calls.end());
  }
  pending_.clear();
  phase_ = Phase::kEnded;
  return out;
}

std::string StreamingCompletionParser::abandon() {
  std::string rest;
  if (phase_ == Phase::kToolCalls) {
    rest = result_.tool_calls.empty() ? cat(chat::kToolCallsStart, pending_)
                                      : pending_.substr(std::min(reader_.end(), pending_.size()));
  } else {
    rest = pending_;
  }
  pending_.clear();
  phase_ = Phase::kEnded;
  return rest;
}

}  // namespace dsv4::tok
