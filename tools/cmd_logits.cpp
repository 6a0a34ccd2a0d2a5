// dsv4 logits: the teacher-forced logits of every prompt position into a safetensors file.
#include "commands.h"
#include "common.h"
#include "core/error.h"
#include "dsv4/engine.h"
#include "io/output_file.h"
#include "io/safetensors.h"
#include "prompt_input.h"

namespace dsv4::cli {
namespace {

int run(const Args& a) {
  // A node > 0 runs its ranks for node 0, which reads the prompt and writes the file.
  if (run_as_follower(engine_options(a, 1))) return 0;
  const std::string out = a.str("--out");
  check_output_path(out);  // before the model runs
  const std::vector<int32_t> prompt = prompt_ids(a);
  const int64_t chunk = a.integer("--prefill-chunk");
  std::unique_ptr<Engine> e = open_engine(a, int64_t(prompt.size()));
  const std::vector<float> logits = e->prompt_logits(prompt, static_cast<int>(chunk));
  SafetensorsWriter w;
  w.add("logits", DType::kF32, {int64_t(prompt.size()), e->info().vocab_size}, logits);
  w.write(out);
  return 0;
}

}  // namespace

const Command& logits_command() {
  static const Command c{
      "logits",
      "teacher-forced logits of every prompt position",
      "dsv4 logits (--model DIR | --random-weights PRESET) (--prompt-ids IDS | --prompt-file FILE "
      "| --prompt TEXT | "
      "--messages FILE) --out FILE.safetensors [flags]",
      "Writes tensor \"logits\", float32 [T, vocab]: row p predicts token p+1. The file is "
      "written\n"
      "to a temporary beside it and renamed into place; only a regular file or a new path is\n"
      "replaced.",
      model_flags("the model directory (config.json, *.safetensors)") + prompt_flags() +
          std::vector<Flag>{
              {"--out", "FILE", "the safetensors file to write", "", true},
              {"--prefill-chunk",
               "N",
               "feed the prompt N tokens per step (1 = token-by-token decode, 0 = one prefill)",
               "0",
               false,
               {},
               0,
               1 << 30},
          } +
          engine_flags(),
      run};
  return c;
}

}  // namespace dsv4::cli
