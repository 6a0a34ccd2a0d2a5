#include "tokenizer/byte_level.h"

namespace dsv4::tok {
namespace {

bool stands_for_itself(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

std::string utf8_of(uint32_t cp) {  // cp < 0x800 here
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

}  // namespace

ByteLevelAlphabet::ByteLevelAlphabet() {
  byte_of_codepoint_.fill(-1);
  uint32_t next_moved = 0x100;
  for (int b = 0; b < 256; ++b) {
    const uint32_t cp = stands_for_itself(b) ? uint32_t(b) : next_moved++;
    chars_[b] = utf8_of(cp);
    byte_of_codepoint_[cp] = int16_t(b);
  }
}

std::optional<std::string> ByteLevelAlphabet::bytes_of(std::string_view token) const {
  std::string out;
  out.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    const auto b0 = static_cast<uint8_t>(token[i]);
    uint32_t cp;
    if (b0 < 0x80) {
      cp = b0;
      i += 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < token.size()) {
      cp = (uint32_t(b0 & 0x1F) << 6) | (static_cast<uint8_t>(token[i + 1]) & 0x3F);
      i += 2;
    } else {
      return std::nullopt;  // 3- and 4-byte characters are never in the alphabet
    }
    if (cp >= byte_of_codepoint_.size() || byte_of_codepoint_[cp] < 0) return std::nullopt;
    out += char(byte_of_codepoint_[cp]);
  }
  return out;
}

}  // namespace dsv4::tok
