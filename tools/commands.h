// The dsv4 subcommands. Each is a Command (args.h): its name, help and flags, and a function
// that takes the parsed arguments and returns the exit code; errors are thrown as dsv4::Error
// and reported by main as one line. A new command defines `const Command& NAME_command()` in
// its cmd_NAME.cpp and adds one line to command_table() (commands.cpp).
#pragma once

#include <vector>

#include "args.h"

namespace dsv4::cli {

const Command& generate_command();
const Command& logits_command();
const Command& plan_command();
const Command& make_tiny_command();
const Command& tokenize_command();
const Command& detokenize_command();
const Command& render_command();
const Command& serve_command();

// Every command, in the order `dsv4 --help` lists them.
const std::vector<const Command*>& command_table();
// Null when there is no command of that name.
const Command* find_command(const std::string& name);

}  // namespace dsv4::cli
