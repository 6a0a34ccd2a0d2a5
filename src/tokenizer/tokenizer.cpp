#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/excerpt.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/utf8.h"

namespace dsv4::tok {

using nlohmann::json;

struct Tokenizer::Impl {
  std::vector<std::string> strings;  // id -> token string as in the file
  std::vector<std::string> bytes;    // id -> bytes it decodes to
  std::vector<uint8_t> present, special, added;
  std::vector<int32_t> added_ids;
  std::unordered_map<std::string, int32_t> vocab, added_by_content;
  AddedTokenMatcher raw_matcher, normalized_matcher;
  std::unique_ptr<PreTokenizer> pre;
  std::unique_ptr<BytePairEncoder> bpe;
};

namespace {

bool null_or(const json& j, const char* key, const json& allowed) {
  return !j.contains(key) || j[key].is_null() || j[key] == allowed;
}

void set_token(Tokenizer::Impl& t, int32_t id, const std::string& s) {
  if (size_t(id) >= t.strings.size()) {
    const size_t n = size_t(id) + 1;
    t.strings.resize(n);
    t.present.resize(n, 0);
    t.special.resize(n, 0);
    t.added.resize(n, 0);
  }
  t.strings[size_t(id)] = s;
  t.present[size_t(id)] = 1;
}

void load_model(Tokenizer::Impl& t, const json& model, const ByteLevelAlphabet& alphabet) {
  DSV4_CHECK(model.is_object() && model.value("type", "") == "BPE",
             "model: only type BPE is supported");
  DSV4_CHECK(null_or(model, "dropout", json()), "model: BPE dropout is not supported");
  DSV4_CHECK(null_or(model, "byte_fallback", false), "model: byte_fallback is not supported");
  DSV4_CHECK(null_or(model, "ignore_merges", false), "model: ignore_merges is not supported");
  DSV4_CHECK(
      null_or(model, "continuing_subword_prefix", "") && null_or(model, "end_of_word_suffix", ""),
      "model: subword prefixes/suffixes are not supported");
  const json& vocab = model.at("vocab");
  DSV4_CHECK(vocab.is_object(), "model.vocab must be an object");
  t.vocab.reserve(vocab.size());
  for (const auto& [token, id] : vocab.items()) {
    DSV4_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < (1 << 30),
               "model.vocab: bad id for '", token, "'");
    set_token(t, id.get<int32_t>(), token);
    t.vocab.emplace(token, id.get<int32_t>());
  }
  std::vector<int32_t> byte_token(256);
  for (int b = 0; b < 256; ++b) {
    auto it = t.vocab.find(alphabet.char_of(uint8_t(b)));
    DSV4_CHECK(it != t.vocab.end(), "model.vocab has no token for byte ", b,
               " (not a byte-level BPE vocabulary)");
    byte_token[size_t(b)] = it->second;
  }
  t.bpe = std::make_unique<BytePairEncoder>(byte_token);
  const json& merges = model.at("merges");
  DSV4_CHECK(merges.is_array(), "model.merges must be a list");
  int32_t rank = 0;
  for (const auto& m : merges) {
    std::string left, right;
    if (m.is_string()) {  // "left right"
      const std::string& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      DSV4_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                 "model.merges[", rank, "]: '", s, "' is not two tokens");
      left = s.substr(0, sp);
      right = s.substr(sp + 1);
    } else {
      DSV4_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
                 "model.merges[", rank, "] is neither \"a b\" nor [a, b]");
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    }
    auto l = t.vocab.find(left), r = t.vocab.find(right), merged = t.vocab.find(left + right);
    DSV4_CHECK(l != t.vocab.end() && r != t.vocab.end() && merged != t.vocab.end(), "model.merges[",
               rank, "]: '", left, "' + '", right, "' is not in the vocabulary");
    t.bpe->add_merge(l->second, r->second, merged->second, rank);
    ++rank;
  }
}

void load_added_tokens(Tokenizer::Impl& t, const json& list) {
  if (list.is_null()) return;
  DSV4_CHECK(list.is_array(), "added_tokens must be a list");
  for (const auto& a : list) {
    DSV4_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() &&
                   a.contains("content") && a["content"].is_string(),
               "added_tokens: entry without an integer id and a content string");
    const int64_t id64 = a["id"].get<int64_t>();
    DSV4_CHECK(id64 >= 0 && id64 < (1 << 30), "added_tokens: bad id ", id64);
    const auto id = int32_t(id64);
    const std::string content = a["content"];
    DSV4_CHECK(!content.empty(), "added_tokens: token ", id, " is empty");
    DSV4_CHECK(
        !a.value("lstrip", false) && !a.value("rstrip", false) && !a.value("single_word", false),
        "added_tokens: token ", id, " uses lstrip/rstrip/single_word (not supported)");
    set_token(t, id, content);
    t.added[size_t(id)] = 1;
    t.special[size_t(id)] = a.value("special", false) ? 1 : 0;
    t.added_ids.push_back(id);
    t.added_by_content[content] = id;
    (a.value("normalized", true) ? t.normalized_matcher : t.raw_matcher).add(content, id);
  }
  std::sort(t.added_ids.begin(), t.added_ids.end());
  t.added_ids.erase(std::unique(t.added_ids.begin(), t.added_ids.end()), t.added_ids.end());
}

void check_supported(const json& root) {
  const json& norm = root.value("normalizer", json());
  DSV4_CHECK(norm.is_null() || (norm.value("type", "") == "Sequence" &&
                                norm.contains("normalizers") && norm["normalizers"].empty()),
             "normalizer: only none (or an empty Sequence) is supported");
  const json& dec = root.value("decoder", json());
  DSV4_CHECK(dec.is_object() && dec.value("type", "") == "ByteLevel",
             "decoder: only ByteLevel is supported");
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream is(path, std::ios::binary);
  DSV4_CHECK(is.good(), path, ": cannot open tokenizer file");
  std::ostringstream ss;
  ss << is.rdbuf();
  return from_json(ss.str(), path);
}

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& origin) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    throw Error(cat(origin, ": invalid JSON: ", parser_message(e.what())));
  }
  auto impl = std::make_unique<Impl>();
  try {
    DSV4_CHECK(root.is_object() && root.contains("model"), "not a tokenizer.json (no model)");
    check_supported(root);
    const ByteLevelAlphabet alphabet;
    load_model(*impl, root["model"], alphabet);
    load_added_tokens(*impl, root.value("added_tokens", json()));
    impl->pre = std::make_unique<PreTokenizer>(root.value("pre_tokenizer", json()));
    impl->bytes.resize(impl->strings.size());
    for (size_t id = 0; id < impl->strings.size(); ++id) {
      // HF's ByteLevel decoder: a token whose characters are all in the byte alphabet stands
      // for those bytes, any other token for its own UTF-8.
      auto b = alphabet.bytes_of(impl->strings[id]);
      impl->bytes[id] = b ? *b : impl->strings[id];
    }
  } catch (const json::exception& e) {
    throw Error(cat(origin, ": ", e.what()));
  } catch (const Error& e) {
    throw Error(cat(origin, ": ", e.what()));
  }
  return Tokenizer(std::move(impl));
}

void Tokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  const PreTokenizer::Scratch scratch(*impl_->pre);
  auto encode_plain = [&](std::string_view plain) {
    impl_->pre->split(plain, scratch,
                      [&](std::string_view piece) { impl_->bpe->encode(piece, out); });
  };
  // Added tokens with "normalized": true are looked for only in the text between the others.
  auto encode_gap = [&](std::string_view gap) {
    size_t pos = 0;
    while (true) {
      const AddedTokenMatcher::Match m = impl_->normalized_matcher.find(gap, pos);
      if (m.id < 0) break;
      encode_plain(gap.substr(pos, m.begin - pos));
      out.push_back(m.id);
      pos = m.begin + m.length;
    }
    encode_plain(gap.substr(pos));
  };
  size_t pos = 0;
  while (true) {
    const AddedTokenMatcher::Match m = impl_->raw_matcher.find(text, pos);
    if (m.id < 0) break;
    encode_gap(text.substr(pos, m.begin - pos));
    out.push_back(m.id);
    pos = m.begin + m.length;
  }
  encode_gap(text.substr(pos));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (is_valid_utf8(text)) {
    encode_text(text, ids);
  } else {
    encode_text(to_valid_utf8(text), ids);
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string raw;
  for (int32_t id : ids) {
    const std::string& b = token_bytes(id);
    if (skip_special && impl_->special[size_t(id)]) continue;
    raw += b;
  }
  return is_valid_utf8(raw) ? raw : to_valid_utf8(raw);
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  DSV4_CHECK(id >= 0 && size_t(id) < impl_->bytes.size() && impl_->present[size_t(id)], "token id ",
             id, " is not in the vocabulary (size ", size(), ")");
  return impl_->bytes[size_t(id)];
}

const std::string& Tokenizer::token_string(int32_t id) const {
  token_bytes(id);  // range check
  return impl_->strings[size_t(id)];
}

int32_t Tokenizer::token_id(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added_by_content.find(key); it != impl_->added_by_content.end())
    return it->second;
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) return it->second;
  return -1;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && size_t(id) < impl_->special.size() && impl_->special[size_t(id)];
}

bool Tokenizer::is_added(int32_t id) const {
  return id >= 0 && size_t(id) < impl_->added.size() && impl_->added[size_t(id)];
}

int32_t Tokenizer::size() const {
  return int32_t(impl_->strings.size());
}

const std::vector<int32_t>& Tokenizer::added_token_ids() const {
  return impl_->added_ids;
}

}  // namespace dsv4::tok
