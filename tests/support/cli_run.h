// Running the dsv4 CLI as users do (through the shell), for the CLI tests.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include "support/temp_dir.h"

namespace dsv4::test {

struct CliResult {
  int code = -1;    // exit status, or -signal
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs `<cli> ARGS` (ARGS already shell-quoted where needed), stderr through a file in `tmp`.
inline CliResult run_cli(const std::string& cli, const std::string& args, const TempDir& tmp) {
  const std::string err_file = tmp / "stderr.txt";
  const std::string cmd = cli + " " + args + " 2>" + err_file;
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    r.err = "popen failed (command line too long?)";
    return r;
  }
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? -WTERMSIG(st) : -1;
  std::ifstream is(err_file);
  r.err.assign(std::istreambuf_iterator<char>(is), {});
  return r;
}

// 'text' for the shell.
inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace dsv4::test
