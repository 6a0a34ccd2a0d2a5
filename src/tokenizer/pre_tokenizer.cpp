#include "tokenizer/pre_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdint>

#include "core/error.h"
#include "tokenizer/unicode_properties.h"

namespace dsv4::tok {

// One compiled pattern: JIT-compiled where PCRE2 supports it, the interpreter otherwise.
class Pcre2Pattern {
 public:
  Pcre2Pattern(const std::string& pattern, bool literal) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    const uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                          &err, &offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw Error(cat("pre-tokenizer pattern /", pattern, "/ does not compile at offset ", offset,
                      ": ", reinterpret_cast<const char*>(msg)));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
    // The default match limit could stop a legitimate match on a huge whitespace run; these
    // patterns backtrack at most linearly, so no limit is needed.
    context_ = pcre2_match_context_create(nullptr);
    DSV4_CHECK(context_, "out of memory creating a PCRE2 match context");
    pcre2_set_match_limit(context_, UINT32_MAX);
  }
  ~Pcre2Pattern() {
    pcre2_match_context_free(context_);
    pcre2_code_free(code_);
  }
  Pcre2Pattern(const Pcre2Pattern&) = delete;
  Pcre2Pattern& operator=(const Pcre2Pattern&) = delete;

  pcre2_code* code() const { return code_; }

  // pcre2 result code; the subject is known to be valid UTF-8.
  int match(std::string_view text, size_t from, pcre2_match_data* md) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    if (jit_) return pcre2_jit_match(code_, subject, text.size(), from, 0, md, context_);
    return pcre2_match(code_, subject, text.size(), from, PCRE2_NO_UTF_CHECK, md, context_);
  }

 private:
  pcre2_code* code_ = nullptr;
  pcre2_match_context* context_ = nullptr;
  bool jit_ = false;
};

PreTokenizer::PreTokenizer(const nlohmann::json& spec) {
  add_spec(spec);
}
PreTokenizer::~PreTokenizer() = default;
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;

void PreTokenizer::add_spec(const nlohmann::json& spec) {
  if (spec.is_null()) return;
  DSV4_CHECK(spec.is_object() && spec.contains("type") && spec["type"].is_string(),
             "pre_tokenizer: expected an object with a \"type\"");
  const std::string type = spec["type"];
  if (type == "Sequence") {
    DSV4_CHECK(spec.contains("pretokenizers") && spec["pretokenizers"].is_array(),
               "pre_tokenizer Sequence without a \"pretokenizers\" list");
    for (const auto& s : spec["pretokenizers"]) add_spec(s);
  } else if (type == "Split") {
    const auto& pat = spec.at("pattern");
    DSV4_CHECK(spec.value("behavior", "") == "Isolated", "pre_tokenizer Split: behavior '",
               spec.value("behavior", ""), "' is not supported (only Isolated)");
    DSV4_CHECK(!spec.value("invert", false), "pre_tokenizer Split: invert is not supported");
    if (pat.contains("Regex")) {
      const std::string regex = pat["Regex"].get<std::string>();
      patterns_.push_back(std::make_unique<Pcre2Pattern>(align_with_oniguruma(regex), false));
    } else if (pat.contains("String")) {
      patterns_.push_back(std::make_unique<Pcre2Pattern>(pat["String"].get<std::string>(), true));
    } else {
      throw Error("pre_tokenizer Split: pattern is neither Regex nor String");
    }
  } else if (type == "ByteLevel") {
    // The byte-to-character mapping is done by the BPE model; the options that change the
    // text are not supported.
    DSV4_CHECK(!spec.value("use_regex", true) && !spec.value("add_prefix_space", true),
               "pre_tokenizer ByteLevel with use_regex or add_prefix_space is not supported");
  } else {
    throw Error(cat("pre_tokenizer type '", type, "' is not supported"));
  }
}

PreTokenizer::Scratch::Scratch(const PreTokenizer& p) {
  for (const auto& pat : p.patterns_) {
    data_.push_back(pcre2_match_data_create_from_pattern(pat->code(), nullptr));
    DSV4_CHECK(data_.back(), "out of memory creating PCRE2 match data");
  }
}

PreTokenizer::Scratch::~Scratch() {
  for (void* d : data_) pcre2_match_data_free(static_cast<pcre2_match_data*>(d));
}

bool PreTokenizer::next_match(size_t level, std::string_view text, size_t from,
                              const Scratch& scratch, size_t* begin, size_t* end) const {
  auto* md = static_cast<pcre2_match_data*>(scratch.match_data(level));
  while (from < text.size()) {
    const int rc = patterns_[level]->match(text, from, md);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw Error(cat("pre-tokenizer regex failed: ", reinterpret_cast<const char*>(msg)));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    if (ov[1] > ov[0]) {
      *begin = ov[0];
      *end = ov[1];
      return true;
    }
    // An empty match splits nothing: search again one character further on.
    from = ov[0] + 1;
    while (from < text.size() && (static_cast<uint8_t>(text[from]) & 0xC0) == 0x80) ++from;
  }
  return false;
}

}  // namespace dsv4::tok
