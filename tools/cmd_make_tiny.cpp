// dsv4 make-tiny: a random checkpoint with the golden sets' geometry (or a --config's, cut to
// --layers, for benchmarks at real shapes). --tokenizer copies a
// tokenizer.json beside it, so text prompts work; the embedding and head then have the
// tokenizer's size in rows unless --vocab says otherwise (BOS stays id 0 and EOS id 1).
#include <cstdio>
#include <filesystem>
#include <optional>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "model/model_config.h"
#include "model/tiny_checkpoint.h"
#include "prompt_input.h"

namespace fs = std::filesystem;

namespace dsv4::cli {
namespace {

// The files a model directory's checkpoint consists of (what --force replaces).
bool checkpoint_file(const fs::path& p) {
  const std::string n = p.filename().string();
  return p.extension() == ".safetensors" || n == "model.safetensors.index.json" ||
         n == "config.json" || n == "generation_config.json" || n == "hf_quant_config.json" ||
         n == "tokenizer.json" || n == "tokenizer_config.json";
}

// An existing non-empty directory is refused unless --force, which removes its checkpoint
// files so that no old shard stays beside the new ones.
void prepare_out_dir(const std::string& out, bool force) {
  if (!fs::exists(fs::symlink_status(out))) return;
  DSV4_CHECK(fs::is_directory(out), out, ": exists and is not a directory");
  if (fs::is_empty(out)) return;
  DSV4_CHECK(force, out, ": directory is not empty (give --force to replace the checkpoint in it)");
  for (const auto& e : fs::directory_iterator(out))
    if (checkpoint_file(e.path())) {
      DSV4_CHECK(e.is_regular_file() || e.is_symlink(), e.path().string(),
                 ": is not a regular file; not removing it");
      fs::remove(e.path());
    }
}

int run(const Args& a) {
  const std::string fmt = a.str("--format"), out = a.str("--out");
  DSV4_CHECK(a.has("--preset") != a.has("--config"), "give exactly one of --preset and --config");
  // A --config geometry (e.g. the real Flash or Pro config.json) takes the flash preset's gains.
  const std::string preset = a.has("--preset") ? a.str("--preset") : "flash";
  ModelConfig c = a.has("--config") ? load_model_config(a.str("--config")) : tiny_preset(preset);
  if (a.has("--layers")) c = first_layers(c, static_cast<int>(a.integer("--layers")));
  TinyInit init = tiny_init(preset);
  init.repeat_experts = a.has("--repeat-experts");
  const uint64_t seed = a.unsigned_integer("--seed");
  const std::optional<std::string> tokenizer_path = a.opt("--tokenizer");
  const int64_t vocab = tokenizer_path     ? vocab_for_tokenizer(a, *tokenizer_path)
                        : a.has("--vocab") ? a.integer("--vocab")
                                           : c.vocab_size;
  DSV4_CHECK(vocab >= 2 && vocab <= (int64_t(1) << 24), "--vocab must be in [2, 2^24], got ",
             vocab);
  c.vocab_size = static_cast<int>(vocab);
  prepare_out_dir(out, a.has("--force"));
  write_tiny_checkpoint(c, fmt == "nvfp4" ? ExpertFormat::kNvfp4 : ExpertFormat::kMxfp4, seed, out,
                        init);
  const fs::path tokenizer_out = fs::path(out) / "tokenizer.json";
  if (tokenizer_path) {
    fs::copy_file(*tokenizer_path, tokenizer_out, fs::copy_options::overwrite_existing);
    // The copy is the model's own (a read-only source must not make it read-only).
    fs::permissions(tokenizer_out, fs::perms::owner_write, fs::perm_options::add);
  }
  const std::string geometry = a.has("--config") ? a.str("--config") : preset;
  std::printf("wrote %s (%s, %d layers, %s, seed %llu, vocab %d%s%s)\n", out.c_str(),
              geometry.c_str(), c.n_layers, fmt.c_str(), static_cast<unsigned long long>(seed),
              c.vocab_size, tokenizer_path ? ", with tokenizer.json" : "",
              init.repeat_experts ? ", repeated experts" : "");
  return 0;
}

}  // namespace

const Command& make_tiny_command() {
  static const Command c{
      "make-tiny",
      "write a random tiny checkpoint",
      "dsv4 make-tiny (--preset flash|pro | --config FILE) --out DIR [flags]",
      "Writes config.json, generation_config.json, sharded safetensors with their index and, for\n"
      "nvfp4, hf_quant_config.json: the official tensor names, dtypes and scale layouts with the\n"
      "golden sets' geometry (or --config's). DIR must be new or empty unless --force.",
      {
          {"--preset", "NAME", "the geometry", "", false, {"flash", "pro"}},
          {"--config", "FILE",
           "a config.json whose geometry to use instead of a preset (e.g. the real Flash's)"},
          {"--layers",
           "N",
           "keep the first N layers and no MTP block (same shapes, fewer layers)",
           "",
           false,
           {},
           1,
           1024},
          {"--repeat-experts", "",
           "every routed expert of a layer repeats one random draw, and large draws run on every "
           "core (other values than without it; for benchmarks)"},
          {"--format", "FMT", "the routed experts' format", "mxfp4", false, {"mxfp4", "nvfp4"}},
          {"--seed", "S", "the weights' seed (a 64-bit unsigned integer)", "0"},
          {"--out", "DIR", "the directory to write", "", true},
          {"--force", "", "replace the checkpoint files of a non-empty DIR"},
          {"--tokenizer", "FILE", "a tokenizer.json to copy to DIR (text prompts, serve)"},
          {"--vocab",
           "N",
           "embedding and head rows (if not given: the tokenizer's size, else the preset's)",
           "",
           false,
           {},
           2,
           1 << 24},
      },
      run};
  return c;
}

}  // namespace dsv4::cli
