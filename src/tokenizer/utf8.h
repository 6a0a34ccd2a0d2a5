// UTF-8 well-formedness for the tokenizer: the invalid-input policy (every ill-formed byte
// sequence becomes U+FFFD, "substitution of maximal subparts" as in Unicode chapter 3, which is
// what Python's errors="replace" and Rust's String::from_utf8_lossy do) and the completeness
// test that streaming decode needs.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace dsv4::tok {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Outcome of reading one sequence at the start of a byte range.
struct Utf8Step {
  size_t length = 0;       // bytes consumed: the sequence, or the maximal ill-formed subpart
  bool valid = false;      // a well-formed scalar value
  bool truncated = false;  // ill-formed only because the range ended mid-sequence
};

// Reads the sequence at s[0] (s must be non-empty).
Utf8Step utf8_step(std::string_view s);

bool is_valid_utf8(std::string_view s);

// `s` with every maximal ill-formed subpart replaced by U+FFFD; `replaced` counts them.
std::string to_valid_utf8(std::string_view s, size_t* replaced = nullptr);

// Bytes at the end of `s` that begin a well-formed sequence the range cuts short (0..3).
size_t incomplete_utf8_tail(std::string_view s);

}  // namespace dsv4::tok
