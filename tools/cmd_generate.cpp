// dsv4 generate: tokens from a prompt, their ids comma-separated on one line.
#include <cstdio>
#include <string>

#include "commands.h"
#include "common.h"
#include "core/error.h"
#include "dsv4/engine.h"
#include "prompt_input.h"

namespace dsv4::cli {
namespace {

int run(const Args& a) {
  // A node > 0 runs its ranks for node 0, which reads the prompt and prints the tokens.
  if (run_as_follower(engine_options(a, 1))) return 0;
  const std::vector<int32_t> prompt = prompt_ids(a);
  SamplingOptions s;
  s.max_new_tokens = a.integer("--max-new-tokens");
  s.temperature = static_cast<float>(a.number("--temperature"));
  s.seed = a.unsigned_integer("--seed");
  s.stop_at_eos = !a.has("--ignore-eos");
  EngineOptions o = engine_options(a, int64_t(prompt.size()) + s.max_new_tokens);
  speculative_options(a, o);
  std::unique_ptr<Engine> e = open_engine(o);
  const std::vector<int32_t> out = e->generate(prompt, s);
  std::string line;
  for (size_t i = 0; i < out.size(); ++i) line += (i ? "," : "") + std::to_string(out[i]);
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace

const Command& generate_command() {
  static const Command c{
      "generate",
      "generate tokens from a prompt",
      "dsv4 generate (--model DIR | --random-weights PRESET) (--prompt-ids IDS | --prompt-file "
      "FILE | --prompt TEXT | "
      "--messages FILE) [flags]",
      "Prints the generated ids comma-separated on one line (the prompt excluded); greedy unless\n"
      "--temperature is above 0; stops after EOS unless --ignore-eos.",
      model_flags("the model directory (config.json, *.safetensors)") + prompt_flags() +
          std::vector<Flag>{
              {"--max-new-tokens", "N", "tokens to generate", "32", false, {}, 0, 1 << 24},
              {"--temperature", "T", "sampling temperature, 0 = greedy", "0", false, {}, 0, 1000},
              {"--seed", "S", "the sampler's seed (a 64-bit unsigned integer)", "0"},
              {"--ignore-eos", "", "do not stop at EOS"},
              speculative_flag(),
              speculative_rollback_flag(),
          } +
          engine_flags(),
      run};
  return c;
}

}  // namespace dsv4::cli
