// dsv4 tokenize --tokenizer FILE (--text T | --file F)
// Prints the token ids of the text comma-separated on one line. No BOS is added; control-token
// strings in the text (<｜User｜>, ...) become their ids. Invalid UTF-8 is not an error: each
// ill-formed sequence is replaced by U+FFFD (as HF tokenizers sees text decoded with
// errors="replace"), with a warning on stderr. FILE may also be a directory holding
// tokenizer.json.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "prompt_input.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace dsv4::cli {

int cmd_tokenize(const Argv& argv) {
  Args a(argv, {"--tokenizer", "--text", "--file"}, {});
  DSV4_CHECK(a.has("--text") != a.has("--file"), "give exactly one of --text and --file");
  std::string text;
  if (a.has("--text")) {
    text = a.str("--text");
  } else {
    const std::string path = a.str("--file");
    std::ifstream is(path, std::ios::binary);
    DSV4_CHECK(is.good() && !std::filesystem::is_directory(path), path, ": cannot open text file");
    std::ostringstream ss;
    ss << is.rdbuf();
    text = ss.str();
  }
  const tok::Tokenizer t = load_tokenizer(a.str("--tokenizer"));
  if (size_t replaced = 0; !tok::is_valid_utf8(text)) {
    tok::to_valid_utf8(text, &replaced);
    std::fprintf(stderr,
                 "dsv4 tokenize: warning: the text is not valid UTF-8; %zu ill-formed "
                 "sequence(s) were encoded as U+FFFD\n",
                 replaced);
  }
  const std::vector<int32_t> ids = t.encode(text);
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ',';
    line += std::to_string(ids[i]);
  }
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace dsv4::cli
