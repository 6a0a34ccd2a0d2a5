// dsv4 detokenize: the text of token ids.
#include <cstdio>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "prompt_input.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::cli {
namespace {

int run(const Args& a) {
  const std::vector<int32_t> ids = parse_ids(a.str("--ids"), "--ids");
  const tok::Tokenizer t = load_tokenizer(a.str("--tokenizer"));
  const std::string text = t.decode(ids, a.has("--skip-special-tokens"));
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace

const Command& detokenize_command() {
  static const Command c{
      "detokenize",
      "the text of token ids",
      "dsv4 detokenize --tokenizer FILE --ids IDS [--skip-special-tokens]",
      "Prints the text exactly (no newline added). Ids that spell an incomplete or ill-formed\n"
      "UTF-8 sequence come out as U+FFFD.",
      {
          {"--tokenizer", "FILE", "a tokenizer.json, or a directory holding one", "", true},
          {"--ids", "IDS", "token ids, comma-separated (\"0,17,42\" or \"0, 17, 42\")", "", true},
          {"--skip-special-tokens", "",
           "drop special added tokens (BOS, EOS, placeholders), keep chat tokens"},
      },
      run};
  return c;
}

}  // namespace dsv4::cli
