// Quoting user input in error messages: at most a short excerpt, with control and non-ASCII
// bytes escaped, so that a 10 MB line or raw binary never ends up in a one-line error.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace dsv4 {

constexpr size_t kExcerptChars = 40;

// 'text' in single quotes; bytes outside printable ASCII as \xNN, quotes and backslashes
// escaped. Longer input is cut after `max_chars` input bytes and marked "...' (N bytes)".
std::string excerpt(std::string_view text, size_t max_chars = kExcerptChars);

// A JSON parser's message (nlohmann's "...; last read: '<token>'") with the quoted token cut
// to an excerpt and the rest escaped and capped at a line's length.
std::string parser_message(std::string_view what);

}  // namespace dsv4
