// dsv4: the command-line front end.
#include <cstdio>
#include <exception>
#include <string>

#include "commands.h"
#include "core/error.h"
#include "core/excerpt.h"

namespace {

using dsv4::cli::command_table;

void list_commands(FILE* to) {
  std::fprintf(to,
               "usage: dsv4 COMMAND [flags]   (dsv4 COMMAND --help for its flags)\ncommands:\n");
  for (const dsv4::cli::Command* c : command_table())
    std::fprintf(to, "  %-12s %s\n", c->name.c_str(), c->summary.c_str());
}

bool is_help(const std::string& a) {
  return a == "--help" || a == "-h";
}

// One line: a message that somehow holds a newline must not break the one-line contract.
std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    list_commands(stderr);
    return 2;
  }
  const std::string name = argv[1];
  if (is_help(name) || name == "help") {
    if (name == "help" && argc > 2) {
      const dsv4::cli::Command* c = dsv4::cli::find_command(argv[2]);
      if (c) {
        std::fputs(dsv4::cli::command_help(*c).c_str(), stdout);
        return 0;
      }
      std::fprintf(stderr, "dsv4: unknown command %s (try dsv4 --help)\n",
                   dsv4::excerpt(argv[2]).c_str());
      return 2;
    }
    list_commands(stdout);
    return 0;
  }
  const dsv4::cli::Command* c = dsv4::cli::find_command(name);
  if (!c) {
    std::fprintf(stderr, "dsv4: unknown command %s (try dsv4 --help)\n",
                 dsv4::excerpt(name).c_str());
    return 2;
  }
  const std::vector<std::string> args(argv + 2, argv + argc);
  // --help / -h in a flag's place (not as the value of one, e.g. --prompt -h).
  for (size_t i = 0; i < args.size(); ++i) {
    if (is_help(args[i])) {
      std::fputs(dsv4::cli::command_help(*c).c_str(), stdout);
      return 0;
    }
    for (const dsv4::cli::Flag& f : c->flags)
      if (f.name == args[i]) {
        if (!f.is_switch()) ++i;  // its value (perhaps past the end: then nothing is left)
        break;
      }
  }
  try {
    return c->run(dsv4::cli::Args(args, c->flags));
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "dsv4 %s: error: %s\n", name.c_str(), one_line(e.what()).c_str());
    return 1;
  }
}
