// dsv4 render: the DeepSeek-V4 prompt for chat messages, as the official encoder writes it.
#include <cstdio>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "prompt_input.h"
#include "tokenizer/prompt_encoder.h"

namespace dsv4::cli {
namespace {

int run(const Args& a) {
  ChatRequest r = read_chat_request(a.str("--messages"));
  if (auto tools = a.opt("--tools")) attach_tools(r.messages, read_json_file(*tools, "tools file"));
  if (auto mode = a.opt("--mode")) r.options.mode = tok::chat::parse_thinking_mode(*mode);
  if (auto effort = a.opt("--reasoning-effort"))
    r.options.reasoning_effort = tok::parse_reasoning_effort(*effort);
  const std::string prompt = tok::encode_messages(r.messages, r.options);
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  return 0;
}

}  // namespace

const Command& render_command() {
  static const Command c{
      "render",
      "the DeepSeek-V4 prompt for chat messages",
      "dsv4 render --messages FILE.json [flags]",
      "Prints the prompt exactly as the official encoder (encoding_dsv4.py) writes it, no newline\n"
      "added. FILE.json is a JSON list of OpenAI-style messages, or an object {\"messages\",\n"
      "\"tools\", \"thinking_mode\", \"reasoning_effort\"}; flags win over its keys.",
      {
          {"--messages", "FILE", "the chat: a JSON list of messages or an object", "", true},
          {"--mode",
           "MODE",
           "chat or thinking (default: the file's, else chat)",
           "",
           false,
           {"chat", "thinking"}},
          {"--reasoning-effort",
           "E",
           "high or max (max adds a preamble in thinking mode)",
           "",
           false,
           {"high", "max"}},
          {"--tools", "FILE", "a JSON list of OpenAI tools, put on the system message"},
      },
      run};
  return c;
}

}  // namespace dsv4::cli
