// dsv4 render --messages FILE.json [--mode chat|thinking] [--reasoning-effort E]
//             [--tools FILE.json]
// Prints the DeepSeek-V4 prompt for the messages exactly as the official encoder
// (encoding_dsv4.py) writes it, with no newline added, ending with the assistant turn's opening
// when the last message is a user turn. FILE.json is a JSON list of OpenAI-style messages (or
// an object {"messages", "tools", "thinking_mode", "reasoning_effort"}; flags win over its
// keys). --mode defaults to chat; --reasoning-effort is high or max (only max changes the
// prompt, in thinking mode); --tools is a JSON list of OpenAI tools, put on the system message.
#include <cstdio>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "prompt_input.h"
#include "tokenizer/prompt_encoder.h"

namespace dsv4::cli {

int cmd_render(const Argv& argv) {
  Args a(argv, {"--messages", "--mode", "--reasoning-effort", "--tools"}, {});
  ChatRequest r = read_chat_request(a.str("--messages"));
  if (auto tools = a.opt("--tools")) attach_tools(r.messages, read_json_file(*tools, "tools file"));
  if (auto mode = a.opt("--mode")) r.options.mode = tok::chat::parse_thinking_mode(*mode);
  if (auto effort = a.opt("--reasoning-effort"))
    r.options.reasoning_effort = tok::parse_reasoning_effort(*effort);
  const std::string prompt = tok::encode_messages(r.messages, r.options);
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  return 0;
}

}  // namespace dsv4::cli
