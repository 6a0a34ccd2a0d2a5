// dsv4 logits --model DIR (--prompt-ids 1,2,3 | --prompt-file F) [--prefill-chunk N]
//             [--backend cpu] [--page-size P] --out FILE.safetensors
// Writes tensor "logits", float32 [T, vocab]: the logits at every prompt position.
// --prefill-chunk N feeds the prompt N tokens per step (1 = token-by-token decode); the
// default is one whole prefill.
#include <cstdio>

#include "commands.h"
#include "common.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "runtime/cpu_runner.h"

namespace dsv4::cli {

int cmd_logits(const Argv& argv) {
  Args a(argv, {"--model", "--prompt-ids", "--prompt-file", "--prefill-chunk", "--backend",
                "--out", "--page-size"},
         {});
  check_backend(a);
  DSV4_CHECK(a.has("--prompt-ids") != a.has("--prompt-file"),
             "give exactly one of --prompt-ids and --prompt-file");
  const std::vector<int32_t> prompt = a.has("--prompt-ids")
                                          ? parse_ids(a.str("--prompt-ids"), "--prompt-ids")
                                          : read_id_file(a.str("--prompt-file"));
  const std::string out = a.str("--out");
  const int64_t chunk = a.integer("--prefill-chunk", 0);
  DSV4_CHECK(chunk >= 0, "--prefill-chunk must be >= 1 (or 0 for one whole prefill)");
  const int64_t page = a.integer("--page-size", 64);
  DSV4_CHECK(page > 0 && page <= 4096, "--page-size must be in [1, 4096]");
  LoadedModel lm = open_model(a);
  const ModelConfig& c = lm.config;
  for (int32_t t : prompt)
    DSV4_CHECK(t < c.vocab_size, "token id ", t, " >= vocab size ", c.vocab_size);

  CpuRunner runner(*lm.model, CacheConfig::for_capacity(c, 1, int64_t(prompt.size()), int(page)));
  const int seq = runner.open_sequence();
  const size_t step = chunk > 0 ? size_t(chunk) : prompt.size();
  std::vector<float> logits;
  logits.reserve(prompt.size() * size_t(c.vocab_size));
  for (size_t i = 0; i < prompt.size(); i += step) {
    const size_t n = std::min(step, prompt.size() - i);
    std::vector<float> l = runner.step(
        {{seq, std::vector<int32_t>(prompt.begin() + i, prompt.begin() + i + n), true}});
    logits.insert(logits.end(), l.begin(), l.end());
  }
  SafetensorsWriter w;
  w.add("logits", DType::kF32, {int64_t(prompt.size()), c.vocab_size}, logits);
  w.write(out);
  return 0;
}

}  // namespace dsv4::cli
