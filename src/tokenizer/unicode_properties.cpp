#include "tokenizer/unicode_properties.h"

#include <cstdio>

namespace dsv4::tok {
namespace {

struct AssignedRange {
  char32_t first, last;
  const char* category;  // two-letter general category in Unicode 16.0
};

constexpr AssignedRange kNewInUnicode16[] = {
#include "tokenizer/unicode16_new_ranges.inc"
};

// Whether general category `cat` (two letters) is matched by property name `name`.
bool property_covers(std::string_view name, std::string_view cat) {
  if (name.size() == 1) return name[0] == cat[0];
  if (name == "L&") return cat == "Lu" || cat == "Ll" || cat == "Lt";
  return name == cat;
}

// Only categories a new character can join; "C" (other) would need subtraction instead.
bool widenable(std::string_view name) {
  if (name.empty() || name.size() > 2) return false;
  if (std::string_view("LMNPSZ").find(name[0]) == std::string_view::npos) return false;
  return name.size() == 1 || name == "L&" || (name[1] >= 'a' && name[1] <= 'z');
}

std::string ranges_for(std::string_view name) {
  std::string out;
  char buf[40];
  for (const AssignedRange& r : kNewInUnicode16) {
    if (!property_covers(name, r.category)) continue;
    if (r.first == r.last) {
      std::snprintf(buf, sizeof buf, "\\x{%X}", unsigned(r.first));
    } else {
      std::snprintf(buf, sizeof buf, "\\x{%X}-\\x{%X}", unsigned(r.first), unsigned(r.last));
    }
    out += buf;
  }
  return out;
}

size_t utf8_length(char lead) {
  const auto b = static_cast<unsigned char>(lead);
  return b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
}

}  // namespace

std::string align_with_oniguruma(std::string_view p) {
  std::string out;
  out.reserve(p.size() * 2);
  bool in_class = false;
  size_t i = 0;
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char d = p[i + 1];
      if (d == 'Q') {  // \Q...\E is literal text
        const size_t e = p.find("\\E", i + 2);
        const size_t end = e == std::string_view::npos ? p.size() : e + 2;
        out.append(p.substr(i, end - i));
        i = end;
        continue;
      }
      if (d == 'p' || d == 'P') {
        size_t end = i + 3;
        std::string_view name;
        if (i + 2 < p.size() && p[i + 2] == '{') {
          const size_t close = p.find('}', i + 3);
          end = close == std::string_view::npos ? p.size() : close + 1;
          name = p.substr(i + 3, end - 1 - (i + 3));
        } else {
          name = p.substr(i + 2, 1);
        }
        const std::string_view original = p.substr(i, end - i);
        bool negated = d == 'P';
        if (!name.empty() && name[0] == '^') {
          negated = !negated;
          name.remove_prefix(1);
        }
        const std::string extra = widenable(name) ? ranges_for(name) : std::string();
        const std::string positive = "\\p{" + std::string(name) + "}";
        if (extra.empty() || (negated && in_class)) {
          out.append(original);
        } else if (in_class) {
          out += positive + extra;
        } else {
          out += (negated ? "[^" : "[") + positive + extra + "]";
        }
        i = end;
        continue;
      }
      if (d == 's' || d == 'S') {  // PCRE2's \s also takes U+180E, Unicode's White_Space not
        out += d == 's' ? "\\p{White_Space}" : "\\P{White_Space}";
        i += 2;
        continue;
      }
      const size_t n = 1 + utf8_length(d);  // any other escape: copy it whole
      out.append(p.substr(i, n));
      i += n;
      continue;
    }
    if (in_class) {
      if (c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:] inside a class
        const size_t e = p.find(":]", i + 2);
        const size_t end = e == std::string_view::npos ? p.size() : e + 2;
        out.append(p.substr(i, end - i));
        i = end;
        continue;
      }
      if (c == ']') in_class = false;
      out += c;
      ++i;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out += c;
      ++i;
      if (i < p.size() && p[i] == '^') out += p[i++];
      if (i < p.size() && p[i] == ']') out += p[i++];  // a leading ] is a literal
      continue;
    }
    out += c;
    ++i;
  }
  return out;
}

}  // namespace dsv4::tok
