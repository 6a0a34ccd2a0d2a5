// The GPT-2 byte-level alphabet that byte-level BPE vocabularies are written in: each byte is
// shown as one printable character (bytes that are printable Latin-1 stand for themselves, the
// other 68 are moved to U+0100..U+0143 in byte order).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace dsv4::tok {

class ByteLevelAlphabet {
 public:
  ByteLevelAlphabet();

  // UTF-8 of the character that stands for byte `b`.
  const std::string& char_of(uint8_t b) const { return chars_[b]; }
  // The byte a token string stands for, or nullopt when one of its characters is not in the
  // alphabet (such tokens, e.g. most added tokens, stand for their own UTF-8 bytes).
  std::optional<std::string> bytes_of(std::string_view token) const;

 private:
  std::array<std::string, 256> chars_;
  std::array<int16_t, 0x144> byte_of_codepoint_;  // -1 where the code point is no byte's
};

}  // namespace dsv4::tok
