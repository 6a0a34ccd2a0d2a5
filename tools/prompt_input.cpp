#include "prompt_input.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/excerpt.h"

namespace dsv4::cli {

using tok::ordered_json;

tok::ordered_json read_json_file(const std::string& path, const char* what) {
  std::ifstream is(path, std::ios::binary);
  DSV4_CHECK(is.good(), path, ": cannot open ", what);
  std::ostringstream ss;
  ss << is.rdbuf();
  try {
    return ordered_json::parse(ss.str());
  } catch (const ordered_json::exception& e) {
    throw Error(cat(path, ": invalid JSON in ", what, ": ", parser_message(e.what())));
  }
}

void attach_tools(ordered_json& messages, const ordered_json& tools) {
  DSV4_CHECK(tools.is_array(), "tools must be a JSON list of OpenAI tool definitions");
  DSV4_CHECK(messages.is_array(), "messages must be a JSON list");
  if (!messages.empty() && messages[0].is_object() && messages[0].value("role", "") == "system") {
    DSV4_CHECK(!messages[0].contains("tools") || messages[0]["tools"].empty(),
               "the system message already has tools; give them in one place");
    messages[0]["tools"] = tools;
  } else {
    const ordered_json system = {{"role", "system"}, {"content", ""}, {"tools", tools}};
    messages.insert(messages.begin(), system);
  }
}

ChatRequest read_chat_request(const std::string& path) {
  ordered_json j = read_json_file(path, "messages file");
  ChatRequest r;
  if (j.is_array()) {
    r.messages = std::move(j);
    return r;
  }
  DSV4_CHECK(j.is_object() && j.contains("messages"), path,
             ": expected a JSON list of messages or an object with \"messages\"");
  for (const auto& [key, value] : j.items())
    DSV4_CHECK(
        key == "messages" || key == "tools" || key == "thinking_mode" || key == "reasoning_effort",
        path, ": unknown key ", excerpt(key),
        " (messages, tools, thinking_mode, reasoning_effort)");
  r.messages = j["messages"];
  DSV4_CHECK(r.messages.is_array(), path, ": \"messages\" must be a list");
  if (j.contains("tools")) attach_tools(r.messages, j["tools"]);
  if (j.contains("thinking_mode")) {
    DSV4_CHECK(j["thinking_mode"].is_string(), path, ": thinking_mode must be a string");
    r.options.mode = tok::chat::parse_thinking_mode(j["thinking_mode"].get<std::string>());
  }
  if (j.contains("reasoning_effort") && !j["reasoning_effort"].is_null()) {
    DSV4_CHECK(j["reasoning_effort"].is_string(), path, ": reasoning_effort must be a string");
    r.options.reasoning_effort = tok::parse_reasoning_effort(j["reasoning_effort"]);
  }
  return r;
}

tok::Tokenizer load_tokenizer(const std::string& path) {
  const bool dir = std::filesystem::is_directory(path);
  return tok::Tokenizer::from_file(dir ? path + "/tokenizer.json" : path);
}

int64_t vocab_for_tokenizer(const Args& a, const std::string& tokenizer_path) {
  DSV4_CHECK(std::filesystem::is_regular_file(tokenizer_path), "--tokenizer ", tokenizer_path,
             ": not a file");
  const int64_t size = load_tokenizer(tokenizer_path).size();
  if (!a.has("--vocab")) return size;
  const int64_t vocab = a.integer("--vocab");
  DSV4_CHECK(vocab >= size, "--vocab ", vocab, " is below the tokenizer's ", size, " ids (",
             tokenizer_path, ")");
  return vocab;
}

std::vector<int32_t> prompt_ids(const Args& a) {
  const char* kinds[] = {"--prompt-ids", "--prompt-file", "--prompt", "--messages"};
  int given = 0;
  for (const char* k : kinds) given += a.has(k);
  DSV4_CHECK(given == 1, given == 0 ? "no prompt" : "several prompts",
             ": give exactly one of --prompt-ids, --prompt-file, --prompt and --messages");
  if (a.has("--prompt-ids")) return parse_ids(a.str("--prompt-ids"), "--prompt-ids");
  if (a.has("--prompt-file")) return read_id_file(a.str("--prompt-file"));
  DSV4_CHECK(a.has("--model"),
             "random weights have no tokenizer: give --prompt-ids or --prompt-file");
  const std::string model_dir = a.str("--model");
  DSV4_CHECK(std::filesystem::exists(model_dir + "/tokenizer.json"), model_dir,
             " has no tokenizer.json, which --prompt and --messages need (give --prompt-ids)");
  const tok::Tokenizer tokenizer = load_tokenizer(model_dir);
  std::string text;
  if (a.has("--prompt")) {
    text = a.str("--prompt");
  } else {
    const ChatRequest r = read_chat_request(a.str("--messages"));
    text = tok::encode_messages(r.messages, r.options);
  }
  std::vector<int32_t> ids = tokenizer.encode(text);
  DSV4_CHECK(!ids.empty(), "the prompt is empty");
  return ids;
}

}  // namespace dsv4::cli
