#include "commands.h"

namespace dsv4::cli {

const std::vector<const Command*>& command_table() {
  static const std::vector<const Command*> table = {
      &generate_command(), &logits_command(),     &plan_command(),   &make_tiny_command(),
      &tokenize_command(), &detokenize_command(), &render_command(), &serve_command(),
  };
  return table;
}

const Command* find_command(const std::string& name) {
  for (const Command* c : command_table())
    if (c->name == name) return c;
  return nullptr;
}

}  // namespace dsv4::cli
