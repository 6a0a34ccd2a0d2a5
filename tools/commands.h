// The dsv4 subcommands. Each takes the arguments after its name and returns the exit code;
// errors are thrown as dsv4::Error and reported by main as one line.
#pragma once

#include <string>
#include <vector>

namespace dsv4::cli {

using Argv = std::vector<std::string>;

int cmd_generate(const Argv& args);
int cmd_logits(const Argv& args);
int cmd_make_tiny(const Argv& args);
int cmd_tokenize(const Argv& args);
int cmd_detokenize(const Argv& args);
int cmd_render(const Argv& args);
int cmd_serve(const Argv& args);

}  // namespace dsv4::cli
