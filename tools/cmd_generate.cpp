// dsv4 generate --model DIR --prompt-ids 1,2,3 [--max-new-tokens N] [--temperature T]
//               [--seed S] [--ignore-eos] [--backend cpu|cuda] [--page-size P]
//               [--dp N] [--ep N] [--tp N]
//               [--verify] [--cache-mb N] [--no-cuda-graphs] [--exact-linears]   (cuda only)
// Prints the generated ids comma-separated on one line.
#include <cstdio>
#include <string>

#include "commands.h"
#include "common.h"
#include "core/error.h"
#include "dsv4/engine.h"
#include "prompt_input.h"

namespace dsv4::cli {

int cmd_generate(const Argv& argv) {
  Args a(argv,
         {"--model", "--prompt-ids", "--prompt", "--messages", "--max-new-tokens", "--temperature",
          "--seed", "--backend", "--page-size", "--cache-mb", "--dp", "--ep", "--tp"},
         {"--ignore-eos", "--verify", "--no-cuda-graphs", "--exact-linears"});
  const std::vector<int32_t> prompt = has_text_prompt(a)
                                          ? text_prompt_ids(a, a.str("--model"))
                                          : parse_ids(a.str("--prompt-ids"), "--prompt-ids");
  SamplingOptions s;
  s.max_new_tokens = a.integer("--max-new-tokens", 32);
  DSV4_CHECK(s.max_new_tokens >= 0 && s.max_new_tokens <= (1 << 24),
             "--max-new-tokens must be in [0, 2^24]");
  const double temperature = a.number("--temperature", 0.0);
  DSV4_CHECK(temperature >= 0, "--temperature must be >= 0");
  s.temperature = static_cast<float>(temperature);
  s.seed = a.unsigned_integer("--seed", 0);
  s.stop_at_eos = !a.has("--ignore-eos");
  std::unique_ptr<Engine> e = open_engine(a, int64_t(prompt.size()) + s.max_new_tokens);
  const std::vector<int32_t> out = e->generate(prompt, s);
  std::string line;
  for (size_t i = 0; i < out.size(); ++i) line += (i ? "," : "") + std::to_string(out[i]);
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace dsv4::cli
