// The tokenizer: UTF-8 policy, byte-level alphabet, BPE merge order and added-token matching
// on a tiny hand-made tokenizer, and the DeepSeek-V4 tokenizer against ids computed by HF
// tokenizers (stored: cross-checked sample strings, render vectors, edge cases, and per-document
// hashes of the ~6 MB test corpus), round trips and streaming decode.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "corpus.h"
#include "test_support.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode_properties.h"
#include "tokenizer/utf8.h"

namespace dsv4::tok::test {
namespace {

using nlohmann::json;

std::string hex_bytes(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out += char(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

// ---- UTF-8 policy ---------------------------------------------------------------------------

TEST(Utf8, ReplacesMaximalSubpartsAsTheUnicodeStandardShows) {
  // Unicode 15 core spec, section 3.9, table 3-8: 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64 becomes
  // a FFFD FFFD FFFD b FFFD c FFFD FFFD d.
  const std::string in = hex_bytes("61F18080E180C262806380BF64");
  size_t replaced = 0;
  const std::string out = to_valid_utf8(in, &replaced);
  const std::string r(kReplacementChar);
  EXPECT_EQ(out, "a" + r + r + r + "b" + r + "c" + r + r + "d");
  EXPECT_EQ(replaced, 6u);
}

TEST(Utf8, RejectsOverlongsSurrogatesAndOutOfRange) {
  for (const char* hex : {"C0AF", "E080AF", "F08080AF", "EDA080", "F4908080", "F5", "FF", "80"})
    EXPECT_FALSE(is_valid_utf8(hex_bytes(hex))) << hex;
  for (const char* hex :
       {"7F", "C280", "DFBF", "E0A080", "ED9FBF", "EE8080", "F0908080", "F48FBFBF"})
    EXPECT_TRUE(is_valid_utf8(hex_bytes(hex))) << hex;
}

TEST(Utf8, IncompleteTailIsOnlyACutShortCharacter) {
  EXPECT_EQ(incomplete_utf8_tail(hex_bytes("61E282")), 2u);    // € cut after 2 of 3 bytes
  EXPECT_EQ(incomplete_utf8_tail(hex_bytes("61F09F98")), 3u);  // 😀 cut after 3 of 4
  EXPECT_EQ(incomplete_utf8_tail(hex_bytes("61E282AC")), 0u);  // complete
  EXPECT_EQ(incomplete_utf8_tail(hex_bytes("61EDA0")), 0u);    // ED A0 can never complete
  EXPECT_EQ(incomplete_utf8_tail(hex_bytes("6180")), 0u);      // stray continuation byte
}

// ---- byte-level alphabet ---------------------------------------------------------------------

TEST(ByteLevel, MapsBytesLikeGpt2) {
  const ByteLevelAlphabet a;
  EXPECT_EQ(a.char_of(' '), "\u0120");   // Ġ
  EXPECT_EQ(a.char_of('\n'), "\u010A");  // Ċ
  EXPECT_EQ(a.char_of(0x00), "\u0100");
  EXPECT_EQ(a.char_of(0xAD), "\u0143");  // the soft hyphen is the last moved byte
  EXPECT_EQ(a.char_of('a'), "a");
  EXPECT_EQ(a.char_of(0xE9), "\u00E9");  // printable Latin-1 stands for itself
  EXPECT_EQ(a.bytes_of("\u0120hi\u010A"), std::optional<std::string>(" hi\n"));
  EXPECT_EQ(a.bytes_of("\uFF5Cx"), std::nullopt);
}

// ---- pre-tokenizer regex ---------------------------------------------------------------------

TEST(UnicodeProperties, RewritesSpaceAndWidensCategories) {
  EXPECT_EQ(align_with_oniguruma("\\s+(?!\\S)"), "\\p{White_Space}+(?!\\P{White_Space})");
  const std::string letters = align_with_oniguruma("[^\\r\\n\\p{L}]");
  EXPECT_EQ(letters.rfind("[^\\r\\n\\p{L}\\x{", 0), 0u) << letters;
  EXPECT_NE(letters.find("\\x{11F04}-"), std::string::npos) << "Kawi letters (Unicode 15.0)";
  EXPECT_EQ(align_with_oniguruma("\\p{Cc}[a-z]\\d"), "\\p{Cc}[a-z]\\d");  // nothing to widen
  EXPECT_EQ(align_with_oniguruma("\\QA\\p{L}\\E"), "\\QA\\p{L}\\E");      // quoted text
}

TEST(PreTokenizer, ClassifiesCharactersAsUnicode16) {
  // U+11F04 KAWI LETTER A (Unicode 15.0) is a letter; U+180E MONGOLIAN VOWEL SEPARATOR is a
  // format character, not white space (Unicode 6.3 on).
  const PreTokenizer pre(json::parse(R"({"type": "Split", "behavior": "Isolated",
      "pattern": {"Regex": "\\p{L}+|\\s+|[^\\s\\p{L}]+"}, "invert": false})"));
  const PreTokenizer::Scratch scratch(pre);
  auto pieces = [&](const std::string& s) {
    std::vector<std::string> out;
    pre.split(s, scratch, [&](std::string_view p) { out.emplace_back(p); });
    return out;
  };
  EXPECT_EQ(pieces("x\U00011F04y z"), (std::vector<std::string>{"x\U00011F04y", " ", "z"}));
  EXPECT_EQ(pieces("a\u180E b"), (std::vector<std::string>{"a", "\u180E", " ", "b"}));
}

// ---- a tiny hand-made tokenizer --------------------------------------------------------------

TEST(TinyTokenizer, MergesLowestRankFirstThenLeftmost) {
  const Tokenizer t = Tokenizer::from_json(tiny_tokenizer_json());
  using V = std::vector<int32_t>;
  EXPECT_EQ(t.encode("abc"), V({258}));        // b+c (rank 0) before a+b (rank 1), then a+bc
  EXPECT_EQ(t.encode("abab"), V({256, 256}));  // equal ranks: leftmost first
  EXPECT_EQ(t.encode("aaa"), V({261, 'a'}));   // a+a at the left, the last a is left over
  EXPECT_EQ(t.encode("aabc"), V({'a', 258}));  // bc (rank 0) takes b first
  EXPECT_EQ(t.encode(" ab abc"), V({' ', 256, ' ', 258}));            // "Ġab" is unreachable: Ġa
                                                                      // comes after b+c and a+b
  EXPECT_EQ(t.encode("12345 a"), V({'1', '2', '3', '4', '5', 259}));  // digits split 3+2
}

TEST(TinyTokenizer, MatchesRawAddedTokensBeforeNormalizedOnes) {
  const Tokenizer t = Tokenizer::from_json(tiny_tokenizer_json());
  using V = std::vector<int32_t>;
  // "xy" (normalized: false) is split off first, so "wxy" never sees its whole text.
  EXPECT_EQ(t.encode("wxyz"), V({'w', 262, 'z'}));
  // Leftmost-longest among the normalized ones.
  EXPECT_EQ(t.encode("a<t>>b<t>"), V({'a', 265, 'b', 264}));
  EXPECT_EQ(t.decode(t.encode("wxyz")), "wxyz");
  EXPECT_EQ(t.decode(t.encode("wxyz"), /*skip_special=*/true), "wz");
}

TEST(TinyTokenizer, RefusesWhatItDoesNotImplement) {
  json j = json::parse(tiny_tokenizer_json());
  j["model"]["byte_fallback"] = true;
  EXPECT_THROW(Tokenizer::from_json(j.dump()), Error);
  j = json::parse(tiny_tokenizer_json());
  j["model"]["merges"].push_back("a zz");
  EXPECT_THROW(Tokenizer::from_json(j.dump()), Error);
  EXPECT_THROW(Tokenizer::from_json("{not json"), Error);
  EXPECT_THROW(Tokenizer::from_file("/nonexistent/tokenizer.json"), Error);
}

// ---- the DeepSeek-V4 tokenizer ---------------------------------------------------------------

class V4Tokenizer : public ::testing::Test {
 protected:
  void SetUp() override {
    tok_ = shared_tokenizer();
    if (!tok_)
      GTEST_SKIP() << "DeepSeek-V4 tokenizer.json not found (set DSV4_TOKENIZER_DIR or provide "
                      "../shared/tokenizer/deepseek-v4)";
  }
  const Tokenizer* tok_ = nullptr;
};

TEST_F(V4Tokenizer, LoadsTheWholeVocabulary) {
  EXPECT_EQ(tok_->size(), 129280);
  EXPECT_EQ(tok_->added_token_ids().size(), 1283u);
  EXPECT_EQ(tok_->token_id("<｜begin▁of▁sentence｜>"), 0);
  EXPECT_EQ(tok_->token_id("<｜User｜>"), 128803);
  EXPECT_TRUE(tok_->is_special(0));
  EXPECT_FALSE(tok_->is_special(128803));  // <｜User｜> survives skip_special decoding
  EXPECT_TRUE(tok_->encode("").empty());
}

TEST_F(V4Tokenizer, MatchesHfRustGoldenSamples) {
  const json v = json::parse(read_file(tokenizer_dir() + "/encoding_tests/render_vectors.json"));
  ASSERT_EQ(v["text_cases_cross_checked"].size(), 13u);
  for (const auto& c : v["text_cases_cross_checked"])
    EXPECT_EQ(tok_->encode(c["text"].get<std::string>()), c["ids"].get<std::vector<int32_t>>())
        << c["text"];
}

TEST_F(V4Tokenizer, MatchesStoredEdgeCases) {
  const json v = json::parse(read_file(source_dir() + "/tests/tokenizer/data/edge_cases.json"));
  ASSERT_GT(v["cases"].size(), 100u);
  for (const auto& c : v["cases"]) {
    const std::string text =
        c.contains("text_hex") ? hex_bytes(c["text_hex"]) : c["text"].get<std::string>();
    EXPECT_EQ(tok_->encode(text), c["ids"].get<std::vector<int32_t>>()) << c.dump().substr(0, 80);
  }
}

TEST_F(V4Tokenizer, EveryAddedTokenIsOneId) {
  const std::vector<int32_t> x = tok_->encode("x");
  ASSERT_EQ(x.size(), 1u);
  for (int32_t id : tok_->added_token_ids()) {
    const std::string& s = tok_->token_string(id);
    ASSERT_EQ(tok_->encode(s), std::vector<int32_t>{id}) << s;
    ASSERT_EQ(tok_->encode("x" + s + "x"), (std::vector<int32_t>{x[0], id, x[0]})) << s;
    ASSERT_EQ(tok_->decode(std::vector<int32_t>{id}), s);
  }
}

TEST_F(V4Tokenizer, InvalidUtf8BecomesReplacementCharacters) {
  const std::string bad = "ok\xFF\xC0\xAF\xED\xA0\x80 \xE4\xB8";
  EXPECT_EQ(tok_->encode(bad), tok_->encode(to_valid_utf8(bad)));
  EXPECT_EQ(tok_->decode(tok_->encode(bad)), to_valid_utf8(bad));
  // Ids that spell a broken character decode to U+FFFD, never to invalid UTF-8.
  const std::vector<int32_t> half_euro = tok_->encode("\xE2\x82\xAC");  // €
  ASSERT_GE(half_euro.size(), 1u);
  const std::string first = tok_->decode(std::vector<int32_t>{half_euro[0]});
  EXPECT_TRUE(is_valid_utf8(first));
  EXPECT_THROW(tok_->decode(std::vector<int32_t>{129280}), Error);
  EXPECT_THROW(tok_->decode(std::vector<int32_t>{-1}), Error);
}

// The ~6 MB corpus against HF's ids, stored as a hash per document (plus the first and last
// ids, which show where a difference starts).
class V4Corpus : public V4Tokenizer {
 protected:
  void SetUp() override {
    V4Tokenizer::SetUp();
    if (IsSkipped()) return;
    if (!docs_) {
      docs_ = new std::vector<CorpusDocument>(
          make_corpus(CorpusSeeds::load(seed_dir()), added_token_strings(*tok_)));
      ids_ = new std::vector<std::vector<int32_t>>();
      for (const auto& d : *docs_) ids_->push_back(tok_->encode(d.text));
    }
  }
  static std::vector<CorpusDocument>* docs_;
  static std::vector<std::vector<int32_t>>* ids_;
};
std::vector<CorpusDocument>* V4Corpus::docs_ = nullptr;
std::vector<std::vector<int32_t>>* V4Corpus::ids_ = nullptr;

TEST_F(V4Corpus, IsLargeAndCoversEveryKind) {
  size_t bytes = 0;
  for (const auto& d : *docs_) bytes += d.text.size();
  EXPECT_GE(bytes, 5u * 1000 * 1000);
  std::vector<std::string> seen;
  for (const auto& d : *docs_) seen.push_back(d.name.substr(0, d.name.rfind('-')));
  for (const char* kind : {"english", "chinese", "code", "emoji", "numbers", "whitespace",
                           "added_tokens", "invalid_utf8", "unicode", "mixed"})
    EXPECT_NE(std::find(seen.begin(), seen.end(), kind), seen.end()) << kind;
  for (const auto& d : *docs_) {
    const bool valid = is_valid_utf8(d.text);
    EXPECT_EQ(valid, d.name.rfind("invalid_utf8", 0) != 0) << d.name;
  }
}

TEST_F(V4Corpus, IdsMatchStoredHfExpectations) {
  const json e =
      json::parse(read_file(source_dir() + "/tests/tokenizer/data/corpus_expected.json"));
  const auto& expected = e["documents"];
  ASSERT_EQ(expected.size(), docs_->size());
  for (size_t i = 0; i < docs_->size(); ++i) {
    const auto& d = (*docs_)[i];
    const auto& x = expected[i];
    ASSERT_EQ(d.name, x["name"]);
    // A different text means the generator changed, not the tokenizer: regenerate the file.
    ASSERT_EQ(sha256_hex(d.text.data(), d.text.size()), x["text_sha256"])
        << d.name << ": corpus text differs from the one the expectations were made for "
        << "(run scripts/tokenizer/regenerate_expected.sh)";
    const auto& ids = (*ids_)[i];
    const auto first = x["first_ids"].get<std::vector<int32_t>>();
    const auto last = x["last_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + std::min(ids.size(), first.size())),
              first)
        << d.name;
    EXPECT_EQ(std::vector<int32_t>(ids.end() - std::min(ids.size(), last.size()), ids.end()), last)
        << d.name;
    EXPECT_EQ(ids.size(), x["token_count"].get<size_t>()) << d.name;
    EXPECT_EQ(ids_sha256(ids), x["ids_sha256"]) << d.name;
  }
}

TEST_F(V4Corpus, DecodeInvertsEncode) {
  for (size_t i = 0; i < docs_->size(); ++i) {
    const std::string& text = (*docs_)[i].text;
    // Valid UTF-8 comes back byte for byte; invalid input comes back as the replaced text.
    EXPECT_EQ(tok_->decode((*ids_)[i]), is_valid_utf8(text) ? text : to_valid_utf8(text))
        << (*docs_)[i].name;
  }
}

TEST_F(V4Corpus, StreamingDecodeNeverSplitsACharacter) {
  for (size_t i = 0; i < docs_->size(); ++i) {
    StreamDecoder dec(*tok_);
    std::string joined;
    size_t held_back = 0;
    for (int32_t id : (*ids_)[i]) {
      const std::string piece = dec.push(id);
      ASSERT_TRUE(is_valid_utf8(piece)) << (*docs_)[i].name;
      held_back = std::max(held_back, dec.pending());
      joined += piece;
    }
    joined += dec.finish();
    EXPECT_EQ(joined, tok_->decode((*ids_)[i])) << (*docs_)[i].name;
    EXPECT_LE(held_back, 3u);
  }
  // Bytes cut off at the end of a stream become U+FFFD, as in a whole decode.
  StreamDecoder dec(*tok_);
  const std::vector<int32_t> smile = tok_->encode("\xF0\x9F\x98\x80");
  ASSERT_GT(smile.size(), 1u);
  EXPECT_EQ(dec.push(smile[0]), "");
  EXPECT_EQ(dec.finish(), tok_->decode(std::vector<int32_t>{smile[0]}));
}

TEST_F(V4Tokenizer, SkipSpecialDropsOnlySpecialTokens) {
  const auto ids = tok_->encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜end▁of▁sentence｜>");
  EXPECT_EQ(tok_->decode(ids, true), "<｜User｜>hi");
}

}  // namespace
}  // namespace dsv4::tok::test
