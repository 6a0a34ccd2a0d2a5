// A HF tokenizers-compatible tokenizer for byte-level BPE tokenizer.json files (DeepSeek-V4's):
// added tokens are matched literally first (tokens with "normalized": false over the whole text,
// then those with "normalized": true in what is left, each leftmost-longest), the rest goes
// through the pre-tokenizer regexes and BPE. No BOS/EOS is ever added.
//
// Invalid UTF-8 policy: input is never rejected. encode() replaces every maximal ill-formed
// subsequence by U+FFFD (as Python's bytes.decode("utf-8", "replace") does before HF sees the
// text), and decode() does the same to byte sequences the ids spell out (as HF's lossy decode).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4::tok {

class Tokenizer {
 public:
  // Reads tokenizer.json; throws dsv4::Error naming the file on any problem.
  static Tokenizer from_file(const std::string& path);
  // `json_text`: the contents of a tokenizer.json; `origin` names it in errors.
  static Tokenizer from_json(std::string_view json_text, const std::string& origin = "tokenizer");

  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  std::vector<int32_t> encode(std::string_view text) const;

  // Concatenated bytes of the ids, made valid UTF-8. Throws dsv4::Error for an id outside the
  // vocabulary. `skip_special` drops ids of added tokens marked "special" (BOS, EOS, pad,
  // placeholders), keeping <｜User｜>, <think>, ... which are not.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // The raw bytes token `id` stands for (possibly part of a UTF-8 character).
  const std::string& token_bytes(int32_t id) const;
  // The token's string as written in tokenizer.json.
  const std::string& token_string(int32_t id) const;
  // Id of an added token or vocabulary entry spelled exactly `token`, or -1.
  int32_t token_id(std::string_view token) const;
  bool is_special(int32_t id) const;
  bool is_added(int32_t id) const;
  // One more than the largest id.
  int32_t size() const;
  // Ids of all added tokens, ascending.
  const std::vector<int32_t>& added_token_ids() const;

  struct Impl;  // the loaded tables (tokenizer.cpp)

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::tok
