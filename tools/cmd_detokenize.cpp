// dsv4 detokenize --tokenizer FILE --ids 1,2,3 [--skip-special-tokens]
// Prints the text of the ids exactly (no newline added). Ids that spell an incomplete or
// ill-formed UTF-8 sequence come out as U+FFFD. --skip-special-tokens drops the special added
// tokens (BOS, EOS, placeholders) but keeps <｜User｜>, <think>, ｜DSML｜, ...
#include <cstdio>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "prompt_input.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::cli {

int cmd_detokenize(const Argv& argv) {
  Args a(argv, {"--tokenizer", "--ids"}, {"--skip-special-tokens"});
  const std::vector<int32_t> ids = parse_ids(a.str("--ids"), "--ids");
  const tok::Tokenizer t = load_tokenizer(a.str("--tokenizer"));
  const std::string text = t.decode(ids, a.has("--skip-special-tokens"));
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace dsv4::cli
