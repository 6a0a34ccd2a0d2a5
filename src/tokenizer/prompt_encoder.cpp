#include "tokenizer/prompt_encoder.h"

#include <algorithm>
#include <map>

#include "core/error.h"
#include "tokenizer/dsml.h"

namespace dsv4::tok {
namespace {

using chat::ThinkingMode;

// msg.get(key) of the official encoder: null when absent.
const ordered_json& get(const ordered_json& msg, const char* key) {
  static const ordered_json kNull;
  auto it = msg.find(key);
  return it == msg.end() ? kNull : *it;
}

// msg.get(key, default): the default only when the key is absent (an explicit null stays).
ordered_json get_or(const ordered_json& msg, const char* key, const ordered_json& fallback) {
  auto it = msg.find(key);
  return it == msg.end() ? fallback : *it;
}

std::string role_of(const ordered_json& msg) {
  const ordered_json& r = get(msg, "role");
  return r.is_string() ? r.get<std::string>() : std::string();
}

bool has_task(const ordered_json& msg) {
  return !get(msg, "task").is_null();
}

// `value or ""` where value must be text.
std::string text_or_empty(const ordered_json& value, const char* what) {
  if (!python_truthy(value)) return "";
  DSV4_CHECK(value.is_string(), what, " must be a string, not a JSON ", value.type_name());
  return value.get<std::string>();
}

void check_messages(const ordered_json& messages, const char* what) {
  DSV4_CHECK(messages.is_array(), what, " must be a JSON list of messages");
  for (size_t i = 0; i < messages.size(); ++i)
    DSV4_CHECK(messages[i].is_object(), what, "[", i, "] is not a JSON object");
}

// Tool messages become tool_result blocks of a user turn; user messages become text blocks,
// appended to the previous user turn unless that one carries a task.
ordered_json merge_tool_messages(const ordered_json& messages) {
  ordered_json merged = ordered_json::array();
  for (const ordered_json& msg : messages) {
    const std::string role = role_of(msg);
    const bool after_blocks = !merged.empty() && role_of(merged.back()) == "user" &&
                              merged.back().contains("content_blocks");
    if (role == "tool") {
      ordered_json block = {{"type", "tool_result"},
                            {"tool_use_id", get_or(msg, "tool_call_id", "")},
                            {"content", get_or(msg, "content", "")}};
      if (after_blocks) {
        merged.back()["content_blocks"].push_back(std::move(block));
      } else {
        merged.push_back({{"role", "user"}, {"content_blocks", ordered_json::array({block})}});
      }
    } else if (role == "user") {
      ordered_json block = {{"type", "text"}, {"text", get_or(msg, "content", "")}};
      if (after_blocks && !has_task(merged.back())) {
        merged.back()["content_blocks"].push_back(std::move(block));
      } else {
        ordered_json m = {{"role", "user"},
                          {"content", get_or(msg, "content", "")},
                          {"content_blocks", ordered_json::array({block})}};
        for (const char* key : {"task", "wo_eos", "mask"})
          if (msg.contains(key)) m[key] = msg[key];
        merged.push_back(std::move(m));
      }
    } else {
      merged.push_back(msg);
    }
  }
  return merged;
}

// Orders the tool results of each user turn like the tool_calls of the latest assistant
// message that made calls (stable; unknown ids sort as position 0).
void sort_tool_results(std::vector<ordered_json*>& messages) {
  std::map<std::string, size_t> order;  // call id (as JSON text) -> position
  for (ordered_json* msg : messages) {
    const std::string role = role_of(*msg);
    if (role == "assistant" && python_truthy(get(*msg, "tool_calls"))) {
      order.clear();
      const ordered_json& calls = (*msg)["tool_calls"];
      DSV4_CHECK(calls.is_array(), "tool_calls must be a list");
      for (size_t i = 0; i < calls.size(); ++i) {
        DSV4_CHECK(calls[i].is_object(), "each tool call must be a JSON object");
        ordered_json id = get(calls[i], "id");
        if (!python_truthy(id)) {
          const ordered_json& fn = get(calls[i], "function");
          id = fn.is_object() ? get_or(fn, "id", "") : ordered_json("");
        }
        if (python_truthy(id)) order[python_json_dumps(id)] = i;
      }
    } else if (role == "user" && python_truthy(get(*msg, "content_blocks"))) {
      ordered_json& blocks = (*msg)["content_blocks"];
      std::vector<ordered_json> results;
      for (const ordered_json& b : blocks)
        if (get(b, "type") == "tool_result") results.push_back(b);
      if (results.size() < 2 || order.empty()) continue;
      auto position = [&](const ordered_json& b) {
        auto it = order.find(python_json_dumps(get_or(b, "tool_use_id", "")));
        return it == order.end() ? size_t(0) : it->second;
      };
      std::stable_sort(
          results.begin(), results.end(),
          [&](const ordered_json& a, const ordered_json& b) { return position(a) < position(b); });
      size_t next = 0;
      for (ordered_json& b : blocks)
        if (get(b, "type") == "tool_result") b = results[next++];
    }
  }
}

// Index of the last user or developer message, -1 if none.
long last_user_index(const ordered_json& messages) {
  for (long i = long(messages.size()) - 1; i >= 0; --i) {
    const std::string role = role_of(messages[size_t(i)]);
    if (role == "user" || role == "developer") return i;
  }
  return -1;
}

// Before the last user/developer message: assistant messages lose their reasoning, messages
// of other roles than user/system/tool/latest_reminder are removed.
ordered_json drop_thinking_messages(const ordered_json& messages) {
  const long last_user = last_user_index(messages);
  ordered_json kept = ordered_json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const ordered_json& msg = messages[i];
    const std::string role = role_of(msg);
    if (role == "user" || role == "system" || role == "tool" || role == "latest_reminder" ||
        role == "direct_search_results" || long(i) >= last_user) {
      kept.push_back(msg);
    } else if (role == "assistant") {
      ordered_json copy = msg;
      copy.erase("reasoning_content");
      kept.push_back(std::move(copy));
    }
  }
  return kept;
}

std::string tools_block(const ordered_json& tools) {
  DSV4_CHECK(tools.is_array(), "tools must be a list");
  std::string schemas;
  for (const ordered_json& t : tools) {
    DSV4_CHECK(t.is_object() && t.contains("function"),
               "each tool must be an object with a \"function\"");
    if (!schemas.empty()) schemas += '\n';
    schemas += python_json_dumps(t["function"]);
  }
  return chat::tools_section(schemas);
}

// The tools and response-format sections of a system or developer message.
std::string system_extras(const ordered_json& msg) {
  std::string s;
  if (python_truthy(get(msg, "tools"))) s += "\n\n" + tools_block(msg["tools"]);
  if (python_truthy(get(msg, "response_format")))
    s += "\n\n" + std::string(chat::kResponseFormatIntro) +
         python_json_dumps(msg["response_format"]);
  return s;
}

// A tool result's content: text, or a list of parts whose text parts are kept.
std::string tool_result_text(const ordered_json& content) {
  if (!content.is_array()) return python_str(content, "tool message content");
  std::string out;
  for (size_t i = 0; i < content.size(); ++i) {
    const ordered_json& part = content[i];
    DSV4_CHECK(part.is_object(), "tool message content parts must be JSON objects");
    if (i) out += "\n\n";
    if (get(part, "type") == "text") {
      out += text_or_empty(get_or(part, "text", ""), "a text part's text");
    } else {
      out += "[Unsupported " + python_str(get(part, "type"), "a content part's type") + "]";
    }
  }
  return out;
}

std::string user_text(const ordered_json& msg) {
  const ordered_json& blocks = get(msg, "content_blocks");
  if (!python_truthy(blocks)) return text_or_empty(get(msg, "content"), "user message content");
  std::string out;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const ordered_json& b = blocks[i];
    if (i) out += "\n\n";
    const ordered_json& type = get(b, "type");
    if (type == "text") {
      const ordered_json text = get_or(b, "text", "");
      DSV4_CHECK(text.is_string(), "user message content must be a string, not a JSON ",
                 text.type_name());
      out += text.get<std::string>();
    } else if (type == "tool_result") {
      out += "<tool_result>" + tool_result_text(get_or(b, "content", "")) + "</tool_result>";
    } else {
      out += "[Unsupported " + python_str(type, "a content block's type") + "]";
    }
  }
  return out;
}

struct Renderer {
  const ordered_json& messages;
  ThinkingMode mode;
  bool drop_thinking;
  const std::optional<std::string>& effort;

  bool thinking() const { return mode == ThinkingMode::kThinking; }

  std::string assistant(size_t index, const ordered_json& msg) const {
    std::string calls;
    if (python_truthy(get(msg, "tool_calls"))) calls = render_dsml_tool_calls(msg["tool_calls"]);
    const std::string content = text_or_empty(get(msg, "content"), "assistant message content");
    const std::string reasoning =
        text_or_empty(get(msg, "reasoning_content"), "assistant reasoning_content");
    const bool prev_has_task = index > 0 && has_task(messages[index - 1]);
    std::string out;
    if (thinking() && !prev_has_task && (!drop_thinking || long(index) > last_user_index(messages)))
      out += reasoning + std::string(chat::kThinkEnd);
    out += content + calls;
    if (!python_truthy(get_or(msg, "wo_eos", false))) out += chat::kEos;
    return out;
  }

  // What follows message `index` when the next message is an assistant or latest_reminder
  // one, or there is none: the assistant turn's opening, or a task token.
  std::string transition(size_t index, const std::string& role) const {
    if (index + 1 < messages.size()) {
      const std::string next = role_of(messages[index + 1]);
      if (next != "assistant" && next != "latest_reminder") return "";
    }
    const ordered_json& task = get(messages[index], "task");
    if (!task.is_null()) {
      const auto token =
          task.is_string() ? chat::task_token(task.get<std::string>()) : std::nullopt;
      DSV4_CHECK(token, "unknown task ", python_json_dumps(task), " (", chat::task_names(), ")");
      if (task != "action") return std::string(*token);
      return std::string(chat::kAssistant) +
             std::string(thinking() ? chat::kThinkStart : chat::kThinkEnd) + std::string(*token);
    }
    if (role != "user" && role != "developer") return "";
    const bool open_thinking =
        thinking() && (!drop_thinking || long(index) >= last_user_index(messages));
    return std::string(chat::kAssistant) +
           std::string(open_thinking ? chat::kThinkStart : chat::kThinkEnd);
  }

  std::string message(size_t index) const {
    const ordered_json& msg = messages[index];
    const std::string role = role_of(msg);
    std::string out;
    if (index == 0 && thinking() && effort == "max") out += chat::kReasoningEffortMax;
    if (role == "system") {
      out += text_or_empty(get(msg, "content"), "system message content") + system_extras(msg);
    } else if (role == "developer") {
      const ordered_json& content = get(msg, "content");
      DSV4_CHECK(python_truthy(content), "a developer message needs non-empty content");
      DSV4_CHECK(content.is_string(), "developer message content must be a string");
      out += std::string(chat::kUser) + content.get<std::string>() + system_extras(msg);
    } else if (role == "user") {
      out += std::string(chat::kUser) + user_text(msg);
    } else if (role == "latest_reminder") {
      out += std::string(chat::kLatestReminder) +
             python_str(get(msg, "content"), "latest_reminder content");
    } else if (role == "assistant") {
      out += assistant(index, msg);
    } else {
      throw Error(cat("unknown message role ", python_json_dumps(get(msg, "role")),
                      " (system, developer, user, assistant, tool, latest_reminder)"));
    }
    return out + transition(index, role);
  }
};

}  // namespace

std::optional<std::string> parse_reasoning_effort(const std::string& name) {
  if (name.empty() || name == "none") return std::nullopt;
  DSV4_CHECK(name == "high" || name == "max", "unknown reasoning effort '", name,
             "' (high, max; the first-release encoder's table)");
  return name;
}

std::string encode_messages(const ordered_json& messages, const EncodeOptions& options) {
  check_messages(messages, "messages");
  check_messages(options.context, "context");
  const auto& effort = options.reasoning_effort;
  DSV4_CHECK(!effort || *effort == "high" || *effort == "max", "unknown reasoning effort '",
             *effort, "' (high, max)");

  // Tool results are ordered with the context's tool calls in view; the context is merged and
  // ordered on its own as well (it was encoded that way before).
  ordered_json raw_context = options.context;
  ordered_json merged = merge_tool_messages(messages);
  {
    std::vector<ordered_json*> all;
    for (auto& m : raw_context) all.push_back(&m);
    for (auto& m : merged) all.push_back(&m);
    sort_tool_results(all);
  }
  ordered_json context = merge_tool_messages(raw_context);
  {
    std::vector<ordered_json*> all;
    for (auto& m : context) all.push_back(&m);
    sort_tool_results(all);
  }
  ordered_json full = context;
  for (const auto& m : merged) full.push_back(m);

  bool drop = options.drop_thinking;
  for (const auto& m : full)
    if (python_truthy(get(m, "tools"))) drop = false;

  size_t to_render = merged.size(), context_len = context.size();
  if (options.mode == ThinkingMode::kThinking && drop) {
    full = drop_thinking_messages(full);
    // As the official encoder counts it: the context's own thinned length is left out.
    const size_t context_kept = drop_thinking_messages(context).size();
    to_render = full.size() > context_kept ? full.size() - context_kept : 0;
    context_len = full.size() - to_render;
  }

  std::string prompt = options.add_bos && context.empty() ? std::string(chat::kBos) : "";
  const Renderer r{full, options.mode, drop, effort};
  for (size_t i = 0; i < to_render; ++i) prompt += r.message(context_len + i);
  return prompt;
}

}  // namespace dsv4::tok
