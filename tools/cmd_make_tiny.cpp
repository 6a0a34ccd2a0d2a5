// dsv4 make-tiny --preset flash|pro --format mxfp4|nvfp4 --seed S --out DIR
//                [--tokenizer FILE] [--vocab N]
// --tokenizer copies FILE (a tokenizer.json) to DIR/tokenizer.json, so text prompts work; the
// embedding and head then have the tokenizer's size in rows unless --vocab N says otherwise
// (an id of the tokenizer >= N is an error). BOS stays id 0 and EOS id 1.
#include <cstdio>
#include <filesystem>
#include <optional>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "model/tiny_checkpoint.h"
#include "prompt_input.h"

namespace dsv4::cli {

int cmd_make_tiny(const Argv& argv) {
  Args a(argv, {"--preset", "--format", "--seed", "--out", "--tokenizer", "--vocab"}, {});
  ModelConfig c = tiny_preset(a.str("--preset"));
  const std::string fmt = a.opt("--format").value_or("mxfp4");
  DSV4_CHECK(fmt == "mxfp4" || fmt == "nvfp4", "unknown --format '", fmt, "' (mxfp4, nvfp4)");
  const uint64_t seed = a.unsigned_integer("--seed", 0);
  const std::string out = a.str("--out");
  const std::optional<std::string> tokenizer_path = a.opt("--tokenizer");
  int64_t tokenizer_size = 0;
  if (tokenizer_path) {
    DSV4_CHECK(std::filesystem::is_regular_file(*tokenizer_path), "--tokenizer ", *tokenizer_path,
               ": not a file");
    tokenizer_size = load_tokenizer(*tokenizer_path).size();
  }
  const int64_t vocab = a.integer("--vocab", tokenizer_path ? tokenizer_size : c.vocab_size);
  DSV4_CHECK(vocab >= 2 && vocab <= (int64_t(1) << 24), "--vocab must be in [2, 2^24], got ",
             vocab);
  DSV4_CHECK(vocab >= tokenizer_size, "--vocab ", vocab, " is below the tokenizer's ",
             tokenizer_size, " ids (", *tokenizer_path, ")");
  c.vocab_size = static_cast<int>(vocab);
  write_tiny_checkpoint(c, fmt == "nvfp4" ? ExpertFormat::kNvfp4 : ExpertFormat::kMxfp4, seed, out,
                        tiny_init(a.str("--preset")));
  const std::filesystem::path tokenizer_out = std::filesystem::path(out) / "tokenizer.json";
  if (tokenizer_path) {
    std::filesystem::copy_file(*tokenizer_path, tokenizer_out,
                               std::filesystem::copy_options::overwrite_existing);
    // The copy is the model's own (a read-only source must not make it read-only).
    std::filesystem::permissions(tokenizer_out, std::filesystem::perms::owner_write,
                                 std::filesystem::perm_options::add);
  } else {
    std::filesystem::remove(tokenizer_out);  // a stale one would not match the new vocabulary
  }
  std::printf("wrote %s (%s, %s, seed %llu, vocab %d%s)\n", out.c_str(), a.str("--preset").c_str(),
              fmt.c_str(), static_cast<unsigned long long>(seed), c.vocab_size,
              tokenizer_path ? ", with tokenizer.json" : "");
  return 0;
}

}  // namespace dsv4::cli
