// dsv4 tokenize: the token ids of a text.
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
namespace {

int run(const Args& a) {
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

}  // namespace

const Command& tokenize_command() {
  static const Command c{
      "tokenize",
      "token ids of a text (tokenizer.json)",
      "dsv4 tokenize --tokenizer FILE (--text T | --file F)",
      "Prints the ids comma-separated on one line. No BOS is added; control-token strings in the\n"
      "text (<\xef\xbd\x9cUser\xef\xbd\x9c>, ...) become their ids. Invalid UTF-8 is encoded "
      "as U+FFFD with a warning.",
      {
          {"--tokenizer", "FILE", "a tokenizer.json, or a directory holding one", "", true},
          {"--text", "T", "the text"},
          {"--file", "F", "a file holding the text"},
      },
      run};
  return c;
}

}  // namespace dsv4::cli
