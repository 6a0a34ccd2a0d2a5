#include "tokenizer/dsml.h"

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "tokenizer/chat_format.h"
#include "tokenizer/read_until.h"

namespace dsv4::tok {
namespace {

constexpr std::string_view kParameterEnd = "/｜DSML｜parameter";  // the '<' before it is read
constexpr std::string_view kTagEnd = ">\n";

// A short, one-line rendering of model text for error messages.
std::string excerpt(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 80)) {
    if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  if (s.size() > 80) out += "...";
  return "'" + out + "'";
}

// Python's str.isspace() characters (what \s matches in the official parser's regex).
size_t python_space_length(std::string_view s) {
  static constexpr std::string_view kMultiByte[] = {
      "\u0085", "\u00A0", "\u1680", "\u2000", "\u2001", "\u2002", "\u2003",
      "\u2004", "\u2005", "\u2006", "\u2007", "\u2008", "\u2009", "\u200A",
      "\u2028", "\u2029", "\u202F", "\u205F", "\u3000"};
  if (s.empty()) return 0;
  const auto c = static_cast<unsigned char>(s[0]);
  if ((c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20)) return 1;
  for (std::string_view m : kMultiByte)
    if (s.substr(0, m.size()) == m) return m.size();
  return 0;
}

// `name="NAME">\n` after optional white space; like the official regex, a second trailing
// newline is allowed (which is how an invoke without parameters reads).
std::string invoke_name(std::string_view content) {
  std::string_view s = content;
  while (size_t n = python_space_length(s)) s.remove_prefix(n);
  constexpr std::string_view kPrefix = "name=\"";
  if (s.substr(0, kPrefix.size()) == kPrefix) {
    s.remove_prefix(kPrefix.size());
    if (s.size() >= 4 && s.substr(s.size() - 4) == "\">\n\n")
      return std::string(s.substr(0, s.size() - 4));
    if (s.size() >= 3 && s.substr(s.size() - 3) == "\">\n")
      return std::string(s.substr(0, s.size() - 3));
  }
  throw Error(cat("DSML tool call: bad invoke name ", excerpt(content)));
}

struct Parameter {
  std::string name, value;
  bool is_string;
};

// ` name="KEY" string="true|false">VALUE<` (the text before "/｜DSML｜parameter").
Parameter parameter(std::string_view content) {
  constexpr std::string_view kPrefix = " name=\"";
  constexpr std::string_view kTrue = "\" string=\"true\">", kFalse = "\" string=\"false\">";
  if (content.substr(0, kPrefix.size()) == kPrefix) {
    const std::string_view rest = content.substr(kPrefix.size());
    size_t value_end = std::string_view::npos;
    if (rest.size() >= 2 && rest.substr(rest.size() - 2) == "<\n")
      value_end = rest.size() - 2;
    else if (!rest.empty() && rest.back() == '<')
      value_end = rest.size() - 1;
    for (size_t j = 0; value_end != std::string_view::npos && j < rest.size(); ++j) {
      const bool t = rest.substr(j, kTrue.size()) == kTrue;
      const bool f = !t && rest.substr(j, kFalse.size()) == kFalse;
      if (!t && !f) continue;
      const size_t value_begin = j + (t ? kTrue.size() : kFalse.size());
      if (value_begin > value_end) break;
      return {std::string(rest.substr(0, j)),
              std::string(rest.substr(value_begin, value_end - value_begin)), t};
    }
  }
  throw Error(cat("DSML tool call: bad parameter ", excerpt(content)));
}

// {"KEY": VALUE, ...}: string parameters JSON-quoted, the others pasted as written.
std::string arguments_json(const std::vector<Parameter>& params) {
  std::string out = "{";
  for (size_t i = 0; i < params.size(); ++i) {
    if (i) out += ", ";
    out += python_json_dumps(params[i].name) + ": ";
    out += params[i].is_string ? python_json_dumps(params[i].value) : params[i].value;
  }
  return out + "}";
}

void expect_tag_end(std::string_view content) {
  DSV4_CHECK(content == kTagEnd, "DSML tool call: expected '>\\n' after a tag, got ",
             excerpt(content));
}

std::string dsml_parameters(const ordered_json& arguments) {
  ordered_json args;
  bool parsed = false;
  if (arguments.is_string()) {
    try {
      args = ordered_json::parse(arguments.get<std::string>());
      parsed = true;
    } catch (const ordered_json::exception&) {
    }
  }
  if (!parsed) args = ordered_json::object({{"arguments", arguments}});
  DSV4_CHECK(args.is_object(), "tool call arguments must be a JSON object, got ",
             python_json_dumps(args));
  std::string out;
  for (const auto& [key, value] : args.items()) {
    if (!out.empty()) out += '\n';
    out += std::string(chat::kParameterOpen) + " name=\"" + key + "\" string=\"" +
           (value.is_string() ? "true" : "false") + "\">" +
           (value.is_string() ? value.get<std::string>() : python_json_dumps(value)) +
           std::string(chat::kParameterClose);
  }
  return out;
}

}  // namespace

std::string render_dsml_tool_calls(const ordered_json& tool_calls) {
  DSV4_CHECK(tool_calls.is_array(), "tool_calls must be a list");
  std::string invokes;
  for (const auto& tc : tool_calls) {
    DSV4_CHECK(tc.is_object() && tc.contains("function") && tc["function"].is_object() &&
                   tc["function"].contains("name") && tc["function"].contains("arguments"),
               "each tool call needs function.name and function.arguments");
    const ordered_json& fn = tc["function"];
    if (!invokes.empty()) invokes += '\n';
    invokes += std::string(chat::kInvokeOpen) + " name=\"" +
               python_str(fn["name"], "tool call name") + "\">\n" +
               dsml_parameters(fn["arguments"]) + "\n" + std::string(chat::kInvokeClose) + ">";
  }
  return "\n\n" + std::string(chat::kToolCallsOpen) + "\n" + invokes + "\n" +
         std::string(chat::kToolCallsClose);
}

DsmlBlockReader::Status DsmlBlockReader::advance(std::string_view text, bool final,
                                                 std::vector<ToolCall>& calls) {
  while (true) {
    if (pos_ >= text.size()) return final ? Status::kEnded : Status::kNeedMore;
    ReadResult r = read_until(text, pos_, {chat::kInvokeOpen, chat::kToolCallsClose}, final);
    if (!r.ready) return Status::kNeedMore;
    expect_tag_end(r.content);
    if (r.stop == 1) {
      pos_ = r.next;
      return Status::kClosed;
    }
    DSV4_CHECK(r.stop == 0, "DSML tool call: the block ends without ",
               std::string(chat::kToolCallsClose));
    r = read_until(text, r.next, {chat::kParameterOpen, chat::kInvokeClose}, final);
    if (!r.ready) return Status::kNeedMore;
    ToolCall call{invoke_name(r.content), ""};
    std::vector<Parameter> params;
    while (r.stop == 0) {
      r = read_until(text, r.next, {kParameterEnd}, final);
      if (!r.ready) return Status::kNeedMore;
      Parameter p = parameter(r.content);
      DSV4_CHECK(std::none_of(params.begin(), params.end(),
                              [&](const Parameter& q) { return q.name == p.name; }),
                 "DSML tool call '", call.name, "': parameter '", p.name, "' given twice");
      params.push_back(std::move(p));
      r = read_until(text, r.next, {chat::kParameterOpen, chat::kInvokeClose}, final);
      if (!r.ready) return Status::kNeedMore;
      expect_tag_end(r.content);
    }
    call.arguments = arguments_json(params);
    calls.push_back(std::move(call));
    pos_ = r.next;
  }
}

}  // namespace dsv4::tok
