// dsv4 logits --model DIR (--prompt-ids 1,2,3 | --prompt-file F) [--prefill-chunk N]
//             [--backend cpu|cuda] [--page-size P] [--verify] [--cache-mb N]
//             [--no-cuda-graphs] [--exact-linears] --out FILE.safetensors
// Writes tensor "logits", float32 [T, vocab]: the logits at every prompt position.
// --prefill-chunk N feeds the prompt N tokens per step (1 = token-by-token decode); the
// default is one whole prefill.
#include "commands.h"
#include "common.h"
#include "core/error.h"
#include "dsv4/engine.h"
#include "io/safetensors.h"
#include "prompt_input.h"

namespace dsv4::cli {

int cmd_logits(const Argv& argv) {
  Args a(argv,
         {"--model", "--prompt-ids", "--prompt-file", "--prompt", "--messages", "--prefill-chunk",
          "--backend", "--out", "--page-size", "--cache-mb", "--dp", "--ep", "--tp"},
         {"--verify", "--no-cuda-graphs", "--exact-linears"});
  DSV4_CHECK(has_text_prompt(a) || a.has("--prompt-ids") != a.has("--prompt-file"),
             "give exactly one of --prompt-ids, --prompt-file, --prompt and --messages");
  const std::vector<int32_t> prompt = has_text_prompt(a) ? text_prompt_ids(a, a.str("--model"))
                                      : a.has("--prompt-ids")
                                          ? parse_ids(a.str("--prompt-ids"), "--prompt-ids")
                                          : read_id_file(a.str("--prompt-file"));
  const std::string out = a.str("--out");
  const int64_t chunk = a.integer("--prefill-chunk", 0);
  DSV4_CHECK(chunk >= 0 && chunk <= (1 << 30),
             "--prefill-chunk must be >= 1 (or 0 for one whole prefill)");
  std::unique_ptr<Engine> e = open_engine(a, int64_t(prompt.size()));
  const std::vector<float> logits = e->prompt_logits(prompt, static_cast<int>(chunk));
  SafetensorsWriter w;
  w.add("logits", DType::kF32, {int64_t(prompt.size()), e->info().vocab_size}, logits);
  w.write(out);
  return 0;
}

}  // namespace dsv4::cli
