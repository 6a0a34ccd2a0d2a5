// /v1/chat/completions (and /tokenize's messages): OpenAI messages, tools and switches -> the
// DeepSeek-V4 prompt, then the engine job.
#include <set>

#include "core/error.h"
#include "server/api_error.h"
#include "server/generation_request.h"
#include "server/sampling_fields.h"
#include "tokenizer/prompt_encoder.h"

namespace dsv4::server {
namespace {

using tok::chat::ThinkingMode;

// OpenAI content: a string, null, or text parts (joined with newlines, as vLLM does).
ordered_json flatten_content(const ordered_json& content, size_t i) {
  if (!content.is_array()) {
    if (!content.is_string() && !content.is_null())
      throw ApiError(400, cat("messages[", i, "].content must be a string or a list of parts"),
                     "messages");
    return content;
  }
  std::string text;
  for (size_t k = 0; k < content.size(); ++k) {
    const ordered_json& part = content[k];
    const std::string at = cat("messages[", i, "].content[", k, "]");
    if (!part.is_object() || JsonFields(part, at + ".").string("type").value_or("") != "text" ||
        !part.contains("text") || !part["text"].is_string())
      throw ApiError(400,
                     at + ": only text parts ({\"type\": \"text\", \"text\": ...}) are supported",
                     "messages");
    if (k) text += "\n";
    text += part["text"].get<std::string>();
  }
  return text;
}

ordered_json normalise_messages(const JsonFields& f) {
  const ordered_json* m = f.array("messages");
  if (!m || m->empty()) throw ApiError(400, "'messages' must be a non-empty list", "messages");
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < m->size(); ++i) {
    const ordered_json& msg = (*m)[i];
    if (!msg.is_object() || !msg.contains("role") || !msg["role"].is_string())
      throw ApiError(400, cat("messages[", i, "] must be an object with a string 'role'"),
                     "messages");
    ordered_json copy = msg;
    if (copy.contains("content")) copy["content"] = flatten_content(copy["content"], i);
    // The newer name of reasoning_content.
    if (copy.contains("reasoning") && !copy.contains("reasoning_content"))
      copy["reasoning_content"] = copy["reasoning"];
    copy.erase("reasoning");
    out.push_back(std::move(copy));
  }
  return out;
}

// OpenAI tool definitions: [{type: "function", function: {name, description?, parameters?}}].
std::set<std::string> check_tools(const ordered_json& tools) {
  std::set<std::string> names;
  for (size_t i = 0; i < tools.size(); ++i) {
    const ordered_json& t = tools[i];
    const std::string at = cat("tools[", i, "]");
    if (!t.is_object() || JsonFields(t, at + ".").string("type").value_or("") != "function" ||
        !t.contains("function") || !t["function"].is_object())
      throw ApiError(400, at + " must be {\"type\": \"function\", \"function\": {...}}", "tools");
    const ordered_json& fn = t["function"];
    if (!fn.contains("name") || !fn["name"].is_string() || fn["name"].get<std::string>().empty())
      throw ApiError(400, at + ".function.name must be a non-empty string", "tools");
    if (fn.contains("description") && !fn["description"].is_string() &&
        !fn["description"].is_null())
      throw ApiError(400, at + ".function.description must be a string", "tools");
    if (fn.contains("parameters") && !fn["parameters"].is_object() && !fn["parameters"].is_null())
      throw ApiError(400, at + ".function.parameters must be a JSON Schema object", "tools");
    if (!names.insert(fn["name"].get<std::string>()).second)
      throw ApiError(400,
                     at + ": the tool name '" + fn["name"].get<std::string>() + "' is given twice",
                     "tools");
  }
  return names;
}

// The system message the official encoder reads tools and response_format from (added, empty,
// when the conversation does not start with one).
ordered_json& system_message(ordered_json& messages) {
  if (JsonFields(messages[0], "messages[0].").string("role").value_or("") != "system")
    messages.insert(messages.begin(), ordered_json{{"role", "system"}, {"content", ""}});
  return messages[0];
}

struct Thinking {
  ThinkingMode mode = ThinkingMode::kChat;
  std::optional<std::string> effort;
};

// chat_template_kwargs {thinking, reasoning_effort}, DeepSeek's thinking {type}, and
// reasoning_effort. Default: chat mode (the official encoder's default), no effort.
Thinking parse_thinking(const JsonFields& f) {
  std::optional<bool> on;
  std::optional<std::string> effort;
  if (const ordered_json* kw = f.object("chat_template_kwargs")) {
    const JsonFields k(*kw, "chat_template_kwargs.");
    on = k.boolean("thinking");
    effort = k.string("reasoning_effort");
  }
  if (const ordered_json* t = f.object("thinking")) {
    const std::string type = JsonFields(*t, "thinking.").string("type").value_or("");
    if (type != "enabled" && type != "disabled")
      f.fail("thinking", "must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}");
    const bool enabled = type == "enabled";
    if (on && *on != enabled) f.fail("thinking", "disagrees with chat_template_kwargs.thinking");
    on = enabled;
  }
  if (const auto e = f.string("reasoning_effort")) {
    if (effort && *effort != *e)
      f.fail("reasoning_effort", "disagrees with chat_template_kwargs.reasoning_effort");
    effort = e;
  }
  Thinking t;
  t.mode = on.value_or(false) ? ThinkingMode::kThinking : ThinkingMode::kChat;
  if (effort) {
    try {
      t.effort = tok::parse_reasoning_effort(*effort);
    } catch (const Error& e) {
      throw ApiError(400, e.what(), "reasoning_effort");
    }
  }
  return t;
}

}  // namespace

void check_model(const ordered_json& body, const std::string& served) {
  const JsonFields f(body);
  const std::optional<std::string> model = f.string("model");
  if (model && *model != served)
    throw ApiError(
        404, cat("the model '", *model, "' does not exist (this server serves '", served, "')"),
        "model");
}

ChatPrompt render_chat_prompt(const ordered_json& body, bool add_bos) {
  const JsonFields f(body);
  ordered_json messages = normalise_messages(f);
  ChatPrompt p;
  const Thinking thinking = parse_thinking(f);
  p.mode = thinking.mode;

  const ordered_json* tools = f.array("tools");
  std::set<std::string> names;
  if (tools && !tools->empty()) names = check_tools(*tools);
  // tool_choice: "none" (tools left out of the prompt), "auto", "required" or a named function.
  std::string choice = names.empty() ? "none" : "auto", named;
  if (const ordered_json* tc = f.get("tool_choice")) {
    if (tc->is_string()) {
      choice = tc->get<std::string>();
      if (choice != "none" && choice != "auto" && choice != "required")
        f.fail("tool_choice", "must be \"none\", \"auto\", \"required\" or a named function");
    } else if (tc->is_object() &&
               JsonFields(*tc, "tool_choice.").string("type").value_or("") == "function" &&
               tc->contains("function") && (*tc)["function"].is_object() &&
               (*tc)["function"].contains("name") && (*tc)["function"]["name"].is_string()) {
      choice = "named";
      named = (*tc)["function"]["name"].get<std::string>();
      if (!names.count(named)) f.fail("tool_choice", cat("names '", named, "', not in tools"));
    } else {
      f.fail("tool_choice", "must be \"none\", \"auto\", \"required\" or a named function");
    }
    if ((choice == "required" || choice == "auto") && names.empty())
      f.fail("tool_choice", cat("is \"", choice, "\" but no tools are given"));
  }
  if (choice != "none") {
    ordered_json& sys = system_message(messages);
    if (sys.contains("tools") && !sys["tools"].empty())
      throw ApiError(400, "the system message has tools of its own; give them in 'tools'",
                     "messages");
    sys["tools"] = *tools;
    p.tools = true;
  }
  if (const ordered_json* rf = f.object("response_format")) {
    const std::string type = JsonFields(*rf, "response_format.").string("type").value_or("");
    if (type == "json_object" || type == "json_schema") {
      // The official encoder's response-format section (no grammar: the model is asked to
      // follow it; its output is not checked).
      system_message(messages)["response_format"] = *rf;
    } else if (type != "text") {
      f.fail("response_format", "type must be \"text\", \"json_object\" or \"json_schema\"");
    }
  }

  tok::EncodeOptions o;
  o.mode = thinking.mode;
  o.reasoning_effort = thinking.effort;
  o.add_bos = add_bos;
  try {
    p.text = tok::encode_messages(messages, o);
  } catch (const Error& e) {
    throw ApiError(400, e.what(), "messages");
  }
  // "required" and a named tool, in chat mode: the assistant turn starts inside a tool-call
  // block, so the model can only answer with a call (in thinking mode the block may only
  // follow the reasoning, which no prefill can force: there they act as "auto").
  if (thinking.mode == ThinkingMode::kChat && (choice == "required" || choice == "named")) {
    p.prefill = cat(tok::chat::kToolCallsStart, ">\n");
    if (choice == "named") p.prefill += cat(tok::chat::kInvokeOpen, " name=\"", named, "\">\n");
    p.text += p.prefill;
  }
  return p;
}

GenerationRequest parse_chat_request(const ordered_json& body, const ParseContext& ctx) {
  check_model(body, ctx.served_model_name);
  const JsonFields f(body);
  const ChatPrompt prompt = render_chat_prompt(body);
  GenerationRequest r;
  r.chat = true;
  r.mode = prompt.mode;
  r.prefill = prompt.prefill;
  r.tools = prompt.tools;
  Job job;
  job.prompt = ctx.tokenizer->encode(prompt.text);
  parse_common_fields(f, ctx, job, r);
  job.sampling.max_new_tokens = parse_max_tokens(f, ctx, int64_t(job.prompt.size()), 1, "messages");
  if (f.boolean("logprobs").value_or(false)) {
    job.sampling.logprobs = true;
    job.sampling.top_logprobs = int(f.integer("top_logprobs", 0, 20).value_or(0));
  } else if (f.integer("top_logprobs", 0, 20).value_or(0) > 0) {
    f.fail("top_logprobs", "needs logprobs: true");
  }
  r.jobs.push_back(std::move(job));
  return r;
}

}  // namespace dsv4::server
