#include "core/excerpt.h"

#include <cstdio>

namespace dsv4 {
namespace {

// Printable ASCII as is (quote and backslash escaped), every other byte as \xNN.
std::string escaped(std::string_view text) {
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\'' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c >= 0x20 && c < 0x7f) {
      out += ch;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

}  // namespace

std::string excerpt(std::string_view text, size_t max_chars) {
  if (text.size() <= max_chars) return "'" + escaped(text) + "'";
  return "'" + escaped(text.substr(0, max_chars)) + "...' (" + std::to_string(text.size()) +
         " bytes)";
}

std::string parser_message(std::string_view what) {
  constexpr std::string_view kLastRead = "last read: '";
  constexpr size_t kMaxMessage = 200;
  const size_t at = what.find(kLastRead);
  std::string_view head = what.substr(0, at == std::string_view::npos ? what.size() : at);
  std::string out = escaped(head.substr(0, kMaxMessage));
  if (head.size() > kMaxMessage) out += "...";
  if (at != std::string_view::npos) {
    std::string_view token = what.substr(at + kLastRead.size());
    if (!token.empty() && token.back() == '\'') token.remove_suffix(1);
    out += "last read: " + excerpt(token);
  }
  return out;
}

}  // namespace dsv4
