// dsv4 generate --model DIR --prompt-ids 1,2,3 [--max-new-tokens N] [--temperature T]
//               [--seed S] [--ignore-eos] [--backend cpu] [--page-size P]
// Prints the generated ids comma-separated on one line.
#include <cstdio>
#include <string>

#include "commands.h"
#include "common.h"
#include "core/error.h"
#include "runtime/cpu_runner.h"
#include "runtime/sampler.h"

namespace dsv4::cli {

int cmd_generate(const Argv& argv) {
  Args a(argv, {"--model", "--prompt-ids", "--max-new-tokens", "--temperature", "--seed",
                "--backend", "--page-size"},
         {"--ignore-eos"});
  check_backend(a);
  const std::vector<int32_t> prompt = parse_ids(a.str("--prompt-ids"), "--prompt-ids");
  const int64_t max_new = a.integer("--max-new-tokens", 32);
  DSV4_CHECK(max_new >= 0 && max_new <= (1 << 24), "--max-new-tokens must be in [0, 2^24]");
  const double temperature = a.number("--temperature", 0.0);
  DSV4_CHECK(temperature >= 0, "--temperature must be >= 0");
  const uint64_t seed = a.unsigned_integer("--seed", 0);
  const int64_t page = a.integer("--page-size", 64);
  DSV4_CHECK(page > 0 && page <= 4096, "--page-size must be in [1, 4096]");
  LoadedModel lm = open_model(a);
  const ModelConfig& c = lm.config;
  for (int32_t t : prompt)
    DSV4_CHECK(t < c.vocab_size, "--prompt-ids: token id ", t, " >= vocab size ", c.vocab_size);

  const int64_t total = int64_t(prompt.size()) + max_new;
  CpuRunner runner(*lm.model, CacheConfig::for_capacity(c, 1, total, int(page)));
  Sampler sampler(static_cast<float>(temperature), seed);
  const int seq = runner.open_sequence();
  std::vector<int32_t> out;
  std::vector<float> logits = runner.step({{seq, prompt, false}});
  for (int64_t i = 0; i < max_new; ++i) {
    const int32_t next = sampler.sample(logits.data(), c.vocab_size);
    out.push_back(next);
    if (next == c.eos_token_id && !a.has("--ignore-eos")) break;
    if (i + 1 < max_new) logits = runner.step({{seq, {next}, false}});
  }
  std::string line;
  for (size_t i = 0; i < out.size(); ++i) line += (i ? "," : "") + std::to_string(out[i]);
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace dsv4::cli
