// The tokenizer against HF tokenizers itself (PyPI `tokenizers`, the Rust library, through
// scripts/tokenizer/hf_oracle.py), run now: ids of every document of the ~6 MB test corpus, and
// the text of id sequences (corpus slices, random ids incl. special and broken-UTF-8 byte
// tokens) with and without skip_special_tokens. Skips, saying why, without python3 + tokenizers
// or the shared tokenizer data.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "corpus.h"
#include "test_support.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::tok::test {
namespace {

std::vector<std::vector<int32_t>> read_id_sequences(const std::string& path) {
  const std::string data = read_file(path);
  std::vector<std::vector<int32_t>> out;
  size_t pos = 0;
  while (pos + 8 <= data.size()) {
    uint64_t n = 0;
    std::memcpy(&n, data.data() + pos, 8);
    pos += 8;
    std::vector<int32_t> ids(n);
    std::memcpy(ids.data(), data.data() + pos, n * 4);
    pos += n * 4;
    out.push_back(std::move(ids));
  }
  return out;
}

void write_id_sequences(const std::string& path, const std::vector<std::vector<int32_t>>& seqs) {
  std::string data;
  for (const auto& ids : seqs) {
    const uint64_t n = ids.size();
    data.append(reinterpret_cast<const char*>(&n), 8);
    data.append(reinterpret_cast<const char*>(ids.data()), n * 4);
  }
  write_file(path, data);
}

std::vector<std::string> read_texts(const std::string& path) {
  const std::string data = read_file(path);
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos + 8 <= data.size()) {
    uint64_t n = 0;
    std::memcpy(&n, data.data() + pos, 8);
    pos += 8;
    out.push_back(data.substr(pos, n));
    pos += n;
  }
  return out;
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitizedBuild = true;
#else
constexpr bool kSanitizedBuild = false;
#endif

class HfOracle : public ::testing::Test {
 protected:
  void SetUp() override {
    // The oracle's half is Python; the sanitizer build checks the same corpus against the
    // stored HF expectations in tokenizer_test instead of paying for HF again.
    if (kSanitizedBuild) GTEST_SKIP() << "HF comparison runs in the non-sanitizer build";
    tok_ = shared_tokenizer();
    if (!tok_) GTEST_SKIP() << "DeepSeek-V4 tokenizer.json not found (set DSV4_TOKENIZER_DIR)";
    if (const std::string why = python_oracle_missing(); !why.empty()) GTEST_SKIP() << why;
    dir_ = make_temp_dir();
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  std::string oracle(const std::string& args) {
    return "python3 " + source_dir() + "/scripts/tokenizer/hf_oracle.py " + args + " --tokenizer " +
           tokenizer_dir() + "/tokenizer.json";
  }
  const Tokenizer* tok_ = nullptr;
  std::string dir_;
};

TEST_F(HfOracle, CorpusIdsAreIdentical) {
  const auto docs = make_corpus(CorpusSeeds::load(seed_dir()), added_token_strings(*tok_));
  write_corpus_file(docs, dir_ + "/corpus.bin");
  ASSERT_EQ(
      run_command(oracle("encode --corpus " + dir_ + "/corpus.bin --out " + dir_ + "/ids.bin")), 0);
  const auto expected = read_id_sequences(dir_ + "/ids.bin");
  ASSERT_EQ(expected.size(), docs.size());
  size_t bytes = 0, tokens = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    const std::vector<int32_t> ids = tok_->encode(docs[i].text);
    bytes += docs[i].text.size();
    tokens += ids.size();
    if (ids == expected[i]) continue;
    size_t k = 0;
    while (k < ids.size() && k < expected[i].size() && ids[k] == expected[i][k]) ++k;
    const size_t from = k > 8 ? k - 8 : 0;
    auto around = [&](const std::vector<int32_t>& v) {
      return tok_->decode(std::vector<int32_t>(v.begin() + long(std::min(from, v.size())),
                                               v.begin() + long(std::min(k + 8, v.size()))));
    };
    ADD_FAILURE() << docs[i].name << ": first difference at token " << k << "; ours decode to '"
                  << around(ids) << "', HF's to '" << around(expected[i]) << "'";
  }
  std::printf("compared %zu documents, %zu bytes, %zu tokens with HF tokenizers\n", docs.size(),
              bytes, tokens);
}

TEST_F(HfOracle, DecodedTextIsIdentical) {
  const auto docs = make_corpus(CorpusSeeds::load(seed_dir()), added_token_strings(*tok_));
  std::vector<std::vector<int32_t>> seqs;
  uint64_t state = 12345;
  auto next = [&] {  // xorshift64
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  // Slices of real documents cut at arbitrary tokens (often inside a character).
  for (const auto& d : docs) {
    const auto ids = tok_->encode(d.text);
    for (int k = 0; k < 20 && !ids.empty(); ++k) {
      const size_t a = next() % ids.size(), n = 1 + next() % 64;
      seqs.emplace_back(ids.begin() + long(a), ids.begin() + long(std::min(ids.size(), a + n)));
    }
  }
  // Random ids over the whole vocabulary, and runs of single-byte tokens.
  std::vector<int32_t> bytes;  // tokens of single bytes 0x80..0xFF: broken UTF-8 when alone
  const ByteLevelAlphabet alphabet;
  for (int b = 0x80; b < 0x100; ++b) bytes.push_back(tok_->token_id(alphabet.char_of(uint8_t(b))));
  ASSERT_EQ(std::count(bytes.begin(), bytes.end(), -1), 0);
  for (int k = 0; k < 300; ++k) {
    std::vector<int32_t> ids;
    for (size_t n = 1 + next() % 40; n > 0; --n) {
      if (next() % 3 == 0)
        ids.push_back(bytes[next() % bytes.size()]);
      else
        ids.push_back(int32_t(next() % uint64_t(tok_->size())));
    }
    seqs.push_back(std::move(ids));
  }
  write_id_sequences(dir_ + "/seqs.bin", seqs);
  for (bool skip : {false, true}) {
    ASSERT_EQ(run_command(oracle(std::string("decode --ids ") + dir_ + "/seqs.bin --out " + dir_ +
                                 "/texts.bin" + (skip ? " --skip-special" : ""))),
              0);
    const auto texts = read_texts(dir_ + "/texts.bin");
    ASSERT_EQ(texts.size(), seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i)
      ASSERT_EQ(tok_->decode(seqs[i], skip), texts[i]) << "sequence " << i << " skip " << skip;
  }
}

}  // namespace
}  // namespace dsv4::tok::test
