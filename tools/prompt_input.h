// Prompts for the model-running commands: token ids (--prompt-ids, --prompt-file), or text:
// --prompt TEXT (tokenized as is; the tokenizer adds no BOS) or --messages FILE.json (rendered
// in DeepSeek-V4's chat format, then tokenized) with the tokenizer.json of the model
// directory. Also the messages-file reader `dsv4 render` shares.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "args.h"
#include "tokenizer/prompt_encoder.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::cli {

// A tokenizer.json, or a directory holding one.
tok::Tokenizer load_tokenizer(const std::string& path);

// The embedding and head rows of weights made for the tokenizer at `tokenizer_path` (make-tiny
// --tokenizer, serve --random-weights): --vocab if given, which must cover every id the
// tokenizer can produce, else the tokenizer's size.
int64_t vocab_for_tokenizer(const Args& a, const std::string& tokenizer_path);

// The prompt of a model-running command (its prompt_flags()): exactly one of --prompt-ids,
// --prompt-file, --prompt and --messages; text is tokenized with <--model>/tokenizer.json.
// Throws dsv4::Error with a one-line reason (none or several given, no tokenizer in the model
// directory, unreadable or invalid messages file, empty prompt, ...).
std::vector<int32_t> prompt_ids(const Args& a);

// A messages file: a JSON list of OpenAI-style messages, or an object {"messages": [...]} that
// may also hold "tools" (attached as attach_tools does), "thinking_mode" ("chat" | "thinking")
// and "reasoning_effort" ("high" | "max"). Without them: chat mode, no effort.
struct ChatRequest {
  tok::ordered_json messages;
  tok::EncodeOptions options;
};
ChatRequest read_chat_request(const std::string& path);

// Reads a JSON file (throws with the path and the parser's message when invalid).
tok::ordered_json read_json_file(const std::string& path, const char* what);

// Puts an OpenAI tools list on the leading system message, adding an empty one when the
// conversation does not start with a system message.
void attach_tools(tok::ordered_json& messages, const tok::ordered_json& tools);

}  // namespace dsv4::cli
