// The pre-tokenizer of tokenizer.json: a sequence of regex splits ("Split", behaviour
// "Isolated": matches and the text between them both become pieces), each applied to every
// piece the previous one produced. Patterns run through PCRE2 in UTF + UCP mode, so \p{L},
// \s, ... follow the Unicode properties as in HF tokenizers' Oniguruma.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dsv4::tok {

class Pcre2Pattern;

class PreTokenizer {
 public:
  // `spec`: the "pre_tokenizer" object. Accepts Split (Regex or String pattern, Isolated, not
  // inverted), ByteLevel without its own regex (the byte mapping is BPE's), and Sequences of
  // those; anything else is refused with dsv4::Error.
  explicit PreTokenizer(const nlohmann::json& spec);
  ~PreTokenizer();
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;

  // PCRE2 match data for one caller at a time (one block per pattern); a PreTokenizer is
  // shared by threads, each with its own Scratch.
  class Scratch {
   public:
    explicit Scratch(const PreTokenizer& p);
    ~Scratch();
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    void* match_data(size_t level) const { return data_[level]; }

   private:
    std::vector<void*> data_;
  };

  // Calls on_piece(std::string_view) for each piece of `text` (valid UTF-8), in order.
  template <typename OnPiece>
  void split(std::string_view text, const Scratch& scratch, OnPiece&& on_piece) const {
    split_level(text, 0, scratch, on_piece);
  }

  size_t num_patterns() const { return patterns_.size(); }

 private:
  // The next match of pattern `level` in text[from..]: true with [*begin, *end) or false.
  bool next_match(size_t level, std::string_view text, size_t from, const Scratch& scratch,
                  size_t* begin, size_t* end) const;

  template <typename OnPiece>
  void split_level(std::string_view text, size_t level, const Scratch& scratch,
                   OnPiece& on_piece) const {
    if (text.empty()) return;
    if (level == patterns_.size()) {
      on_piece(text);
      return;
    }
    size_t pos = 0, begin = 0, end = 0;
    while (pos < text.size() && next_match(level, text, pos, scratch, &begin, &end)) {
      split_level(text.substr(pos, begin - pos), level + 1, scratch, on_piece);
      split_level(text.substr(begin, end - begin), level + 1, scratch, on_piece);
      pos = end;
    }
    split_level(text.substr(pos), level + 1, scratch, on_piece);
  }

  void add_spec(const nlohmann::json& spec);

  std::vector<std::unique_ptr<Pcre2Pattern>> patterns_;
};

}  // namespace dsv4::tok
