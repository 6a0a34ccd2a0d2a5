// dsv4: the command-line front end.
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <string>

#include "commands.h"
#include "core/error.h"

namespace {

using Command = std::function<int(const dsv4::cli::Argv&)>;

const std::map<std::string, std::pair<Command, const char*>>& commands() {
  static const std::map<std::string, std::pair<Command, const char*>> table = {
      {"generate", {dsv4::cli::cmd_generate, "generate tokens from a prompt"}},
      {"logits", {dsv4::cli::cmd_logits, "teacher-forced logits of every prompt position"}},
      {"make-tiny", {dsv4::cli::cmd_make_tiny, "write a random tiny checkpoint"}},
      {"tokenize", {dsv4::cli::cmd_tokenize, "token ids of a text (tokenizer.json)"}},
      {"detokenize", {dsv4::cli::cmd_detokenize, "the text of token ids"}},
      {"render", {dsv4::cli::cmd_render, "the DeepSeek-V4 prompt for chat messages"}},
      {"serve", {dsv4::cli::cmd_serve, "the OpenAI-compatible HTTP server"}},
  };
  return table;
}

void usage() {
  std::fprintf(stderr, "usage: dsv4 <command> [flags]\ncommands:\n");
  for (const auto& [name, c] : commands())
    std::fprintf(stderr, "  %-12s %s\n", name.c_str(), c.second);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage();
    return 2;
  }
  const std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    usage();
    return 0;
  }
  auto it = commands().find(name);
  if (it == commands().end()) {
    std::fprintf(stderr, "dsv4: unknown command '%s' (try dsv4 --help)\n", name.c_str());
    return 2;
  }
  try {
    return it->second.first(dsv4::cli::Argv(argv + 2, argv + argc));
  } catch (const dsv4::Error& e) {
    std::fprintf(stderr, "dsv4 %s: error: %s\n", name.c_str(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsv4 %s: error: %s\n", name.c_str(), e.what());
    return 1;
  }
}
