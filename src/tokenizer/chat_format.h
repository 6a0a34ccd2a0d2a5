// The literal strings of DeepSeek-V4's prompt format (first release, encoding_dsv4.py): control
// tokens, task tokens, DSML tags and the fixed prompt texts. Models see these byte for byte.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace dsv4::tok::chat {

// "chat": answers directly; "thinking": the model reasons first, then writes </think>.
enum class ThinkingMode { kChat, kThinking };
// "chat" or "thinking"; throws dsv4::Error otherwise.
ThinkingMode parse_thinking_mode(std::string_view name);

inline constexpr std::string_view kBos = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kUser = "<｜User｜>";
inline constexpr std::string_view kAssistant = "<｜Assistant｜>";
inline constexpr std::string_view kLatestReminder = "<｜latest_reminder｜>";
inline constexpr std::string_view kThinkStart = "<think>";
inline constexpr std::string_view kThinkEnd = "</think>";
inline constexpr std::string_view kDsml = "｜DSML｜";

// DSML tags (kDsml inside angle brackets).
inline constexpr std::string_view kToolCallsOpen = "<｜DSML｜tool_calls>";
inline constexpr std::string_view kToolCallsClose = "</｜DSML｜tool_calls>";
inline constexpr std::string_view kInvokeOpen = "<｜DSML｜invoke";        // + ` name="N">`
inline constexpr std::string_view kInvokeClose = "</｜DSML｜invoke";      // + `>`
inline constexpr std::string_view kParameterOpen = "<｜DSML｜parameter";  // + ` name=.. string=..>`
inline constexpr std::string_view kParameterClose = "</｜DSML｜parameter>";
// What starts a tool-call block in a completion: the two newlines belong to it.
inline constexpr std::string_view kToolCallsStart = "\n\n<｜DSML｜tool_calls";

// Token of a task ("action", "query", ...), or nullopt for an unknown task.
std::optional<std::string_view> task_token(std::string_view task);
// "action, authority, domain, query, read_url, title" for error messages.
std::string_view task_names();

// The tools section for a system/developer message; `tool_schemas` is one JSON line per tool.
std::string tools_section(std::string_view tool_schemas);

inline constexpr std::string_view kResponseFormatIntro =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

// Written at the start of the prompt for reasoning effort "max" in thinking mode.
inline constexpr std::string_view kReasoningEffortMax =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n";

}  // namespace dsv4::tok::chat
