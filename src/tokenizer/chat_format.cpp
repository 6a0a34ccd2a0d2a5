#include "tokenizer/chat_format.h"

#include <array>
#include <utility>

#include "core/error.h"

namespace dsv4::tok::chat {

ThinkingMode parse_thinking_mode(std::string_view name) {
  if (name == "chat") return ThinkingMode::kChat;
  if (name == "thinking") return ThinkingMode::kThinking;
  throw Error(cat("unknown thinking mode '", name, "' (chat, thinking)"));
}

std::optional<std::string_view> task_token(std::string_view task) {
  static constexpr std::array<std::pair<std::string_view, std::string_view>, 6> kTasks = {{
      {"action", "<｜action｜>"},
      {"query", "<｜query｜>"},
      {"authority", "<｜authority｜>"},
      {"domain", "<｜domain｜>"},
      {"title", "<｜title｜>"},
      {"read_url", "<｜read_url｜>"},
  }};
  for (const auto& [name, token] : kTasks)
    if (name == task) return token;
  return std::nullopt;
}

std::string_view task_names() {
  return "action, authority, domain, query, read_url, title";
}

std::string tools_section(std::string_view tool_schemas) {
  std::string s =
      "## Tools\n\n"
      "You have access to a set of tools to help answer the user's question. You can invoke "
      "tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n"
      "<｜DSML｜tool_calls>\n"
      "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
      "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE"
      "</｜DSML｜parameter>\n"
      "...\n"
      "</｜DSML｜invoke>\n"
      "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
      "...\n"
      "</｜DSML｜invoke>\n"
      "</｜DSML｜tool_calls>\n\n"
      "String parameters should be specified as is and set `string=\"true\"`. For all other "
      "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
      "`string=\"false\"`.\n\n"
      "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
      "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
      "Otherwise, output directly after </think> with tool calls or final response.\n\n"
      "### Available Tool Schemas\n\n";
  s += tool_schemas;
  s += "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
       "tool calls.\n";
  return s;
}

}  // namespace dsv4::tok::chat
