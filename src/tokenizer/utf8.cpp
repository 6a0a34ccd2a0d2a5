#include "tokenizer/utf8.h"

#include <cstdint>

namespace dsv4::tok {
namespace {

// Unicode Table 3-7 (well-formed UTF-8): the allowed range of the second byte depends on the
// lead byte; later continuation bytes are always 80..BF.
struct LeadRule {
  uint8_t length, second_lo, second_hi;
};

LeadRule lead_rule(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};  // 80..C1, F5..FF never start a sequence
}

}  // namespace

Utf8Step utf8_step(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const LeadRule r = lead_rule(p[0]);
  if (r.length == 1) return {1, true, false};
  if (r.length == 0) return {1, false, false};
  for (size_t i = 1; i < r.length; ++i) {
    if (i >= s.size()) return {i, false, true};
    const uint8_t lo = i == 1 ? r.second_lo : 0x80, hi = i == 1 ? r.second_hi : 0xBF;
    if (p[i] < lo || p[i] > hi) return {i, false, false};
  }
  return {r.length, true, false};
}

bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step st = utf8_step(s.substr(i));
    if (!st.valid) return false;
    i += st.length;
  }
  return true;
}

std::string to_valid_utf8(std::string_view s, size_t* replaced) {
  std::string out;
  out.reserve(s.size());
  size_t count = 0, i = 0;
  while (i < s.size()) {
    size_t j = i;
    while (j < s.size() && static_cast<uint8_t>(s[j]) < 0x80) ++j;
    out.append(s.substr(i, j - i));
    i = j;
    if (i == s.size()) break;
    const Utf8Step st = utf8_step(s.substr(i));
    if (st.valid) {
      out.append(s.substr(i, st.length));
    } else {
      out.append(kReplacementChar);
      ++count;
    }
    i += st.length;
  }
  if (replaced) *replaced = count;
  return out;
}

size_t incomplete_utf8_tail(std::string_view s) {
  // A cut-short sequence is at most 3 bytes long, so only the last 3 bytes can start one.
  const size_t from = s.size() > 3 ? s.size() - 3 : 0;
  for (size_t i = from; i < s.size(); ++i) {
    const Utf8Step st = utf8_step(s.substr(i));
    if (st.truncated && i + st.length == s.size()) return st.length;
  }
  return 0;
}

}  // namespace dsv4::tok
