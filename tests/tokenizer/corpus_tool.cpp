// tokenizer_corpus --tokenizer FILE --out FILE
// Writes the test corpus (corpus.h) in the length-prefixed form the Python oracle reads; used to
// regenerate the stored expectations (scripts/tokenizer/hf_oracle.py expected).
#include <cstdio>
#include <string>

#include "core/error.h"
#include "corpus.h"
#include "test_support.h"

int main(int argc, char** argv) {
  using namespace dsv4::tok;
  try {
    std::string tokenizer, out;
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string flag = argv[i];
      if (flag == "--tokenizer")
        tokenizer = argv[i + 1];
      else if (flag == "--out")
        out = argv[i + 1];
      else
        throw dsv4::Error("unknown argument '" + flag + "'");
    }
    DSV4_CHECK(!tokenizer.empty() && !out.empty() && argc == 5,
               "usage: tokenizer_corpus --tokenizer FILE --out FILE");
    const Tokenizer t = Tokenizer::from_file(tokenizer);
    const auto docs =
        test::make_corpus(test::CorpusSeeds::load(test::seed_dir()), test::added_token_strings(t));
    test::write_corpus_file(docs, out);
    size_t bytes = 0;
    for (const auto& d : docs) bytes += d.text.size();
    std::printf("wrote %s: %zu documents, %zu bytes\n", out.c_str(), docs.size(), bytes);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenizer_corpus: error: %s\n", e.what());
    return 1;
  }
}
