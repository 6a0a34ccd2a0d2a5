// The tokenizer test and benchmark corpus: about 6 MB of mixed text (English, Chinese and other
// scripts, code, markdown, emoji, numbers, whitespace runs, every added token, invalid UTF-8,
// random code points) generated deterministically from a seed and the small committed seed
// texts in tests/tokenizer/data/seed/, so the repository carries kilobytes, not megabytes. The
// same inputs give the same bytes with every compiler and standard library (own PRNG, no
// std::*_distribution).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dsv4::tok::test {

struct CorpusSeeds {
  std::string english, chinese, multilingual, code;
  // Reads english.txt, chinese.txt, multilingual.txt and code.txt from `dir`.
  static CorpusSeeds load(const std::string& dir);
};

struct CorpusDocument {
  std::string name;  // "<kind>-<n>", e.g. "emoji-2"
  std::string text;  // raw bytes; only the invalid_utf8 documents are not valid UTF-8
};

inline constexpr uint64_t kCorpusSeed = 20260601;
inline constexpr size_t kDocumentBytes = 128 * 1024;  // each document is at least this long

// `added_tokens`: the contents of every added token of the tokenizer (all appear, many times).
std::vector<CorpusDocument> make_corpus(const CorpusSeeds& seeds,
                                        const std::vector<std::string>& added_tokens,
                                        uint64_t seed = kCorpusSeed);

// Length-prefixed file used to hand the corpus to the Python oracle: per document, u32 name
// length, name, u64 text length, text (little-endian).
void write_corpus_file(const std::vector<CorpusDocument>& docs, const std::string& path);

// <source>/tests/tokenizer/data/seed.
std::string seed_dir();

}  // namespace dsv4::tok::test
