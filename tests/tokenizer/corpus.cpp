#include "corpus.h"

#include <fstream>
#include <functional>
#include <sstream>
#include <string_view>

#include "core/error.h"

namespace dsv4::tok::test {
namespace {

// splitmix64: tiny, and its output is fixed by this code alone.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return n ? size_t(next() % n) : 0; }
  size_t between(size_t lo, size_t hi) { return lo + below(hi - lo + 1); }  // inclusive
  bool percent(int p) { return below(100) < size_t(p); }
  template <typename T>
  const T& pick(const std::vector<T>& v) {
    return v[below(v.size())];
  }

 private:
  uint64_t state_;
};

// Appends in reading order. Operands of one `+` may be evaluated in any order, so an expression
// with two random draws would differ between compilers; the operands of << are evaluated left
// to right (C++17), which keeps the corpus identical everywhere.
struct Text {
  std::string s;
  Text& operator<<(std::string_view v) {
    s += v;
    return *this;
  }
  operator std::string() const { return s; }
};

std::string utf8(char32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3F));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

std::string utf8(std::initializer_list<char32_t> cps) {
  std::string s;
  for (char32_t c : cps) s += utf8(c);
  return s;
}

std::vector<std::string> split(const std::string& text, std::string_view sep) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t e = text.find(sep, pos);
    if (e == std::string::npos) e = text.size();
    if (e > pos) out.push_back(text.substr(pos, e - pos));
    pos = e + sep.size();
  }
  return out;
}

// Characters of a UTF-8 string (each as its bytes).
std::vector<std::string> characters(std::string_view s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    const size_t n = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
    out.emplace_back(s.substr(i, n));
    i += n;
  }
  return out;
}

class Generator {
 public:
  Generator(const CorpusSeeds& seeds, const std::vector<std::string>& added, uint64_t seed)
      : rng_(seed), added_(added) {
    english_ = split(seeds.english, "\n");
    chinese_ = split(seeds.chinese, "\n");
    multilingual_ = split(seeds.multilingual, "\n");
    code_ = split(seeds.code, "=====\n");
    DSV4_CHECK(!english_.empty() && !chinese_.empty() && !multilingual_.empty() && !code_.empty(),
               "corpus seed texts are empty");
    for (const std::string& line : english_)
      for (const std::string& w : split(line, " ")) words_.push_back(w);
  }

  std::string unit(const std::string& kind) {
    if (kind == "english") return english();
    if (kind == "chinese") return chinese();
    if (kind == "multilingual") return multilingual();
    if (kind == "code") return code();
    if (kind == "markdown") return markdown();
    if (kind == "emoji") return emoji();
    if (kind == "numbers") return numbers();
    if (kind == "whitespace") return whitespace();
    if (kind == "added_tokens") return added_tokens();
    if (kind == "invalid_utf8") return invalid_utf8();
    if (kind == "unicode") return random_unicode();
    if (kind == "mixed") return mixed();
    throw Error(cat("unknown corpus kind ", kind));
  }

  // Every added token once, in shuffled order, each in a random context.
  std::string all_added_tokens() {
    std::vector<size_t> order(added_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng_.below(i)]);
    std::string out;
    for (size_t i : order) out += added_in_context(added_[i]);
    return out;
  }

 private:
  std::string made_up_word() {
    static const std::vector<std::string> onset = {
        "b", "c", "d", "f", "g", "h", "j",  "k",  "l",  "m",  "n",  "p",  "qu", "r",
        "s", "t", "v", "w", "x", "z", "st", "tr", "ch", "sh", "th", "br", "pl", "gr"};
    static const std::vector<std::string> vowel = {"a", "e",  "i",  "o",  "u",
                                                   "y", "ai", "ou", "ee", "io"};
    std::string w;
    for (size_t n = rng_.between(1, 4); n > 0; --n) {
      w += rng_.pick(onset);
      w += rng_.pick(vowel);
    }
    if (rng_.percent(30)) w += rng_.pick(onset);
    if (rng_.percent(12)) w[0] = char(w[0] - 'a' + 'A');
    if (rng_.percent(3)) {
      for (char& c : w) c = char(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
    }
    return w;
  }

  std::string sentence() {
    if (rng_.percent(70)) return rng_.pick(english_);
    std::string s;
    for (size_t n = rng_.between(4, 22); n > 0; --n) {
      if (!s.empty()) s += rng_.percent(4) ? ", " : " ";
      s += rng_.percent(15) ? made_up_word() : rng_.pick(words_);
      if (rng_.percent(5)) s += rng_.pick(std::vector<std::string>{"'s", "-based", "ing", "ed"});
      if (rng_.percent(3)) {
        s += ' ';
        s += std::to_string(rng_.below(100000));
      }
    }
    static const std::vector<std::string> ends = {".", ".", ".", "!", "?", "...", ";", ":", "?!"};
    return s + rng_.pick(ends);
  }

  std::string english() {
    std::string p;
    for (size_t n = rng_.between(1, 7); n > 0; --n) {
      if (!p.empty()) p += ' ';
      p += sentence();
    }
    return p + (rng_.percent(80) ? "\n\n" : "\n");
  }

  std::string chinese() {
    std::string p;
    for (size_t n = rng_.between(1, 5); n > 0; --n) {
      p += rng_.pick(chinese_);
      if (rng_.percent(15)) p += rng_.pick(words_);
      if (rng_.percent(15)) p += std::to_string(rng_.below(1000000));
      if (rng_.percent(8)) {  // a long run of CJK ideographs / kana: one long pre-token
        const char32_t base = rng_.percent(80) ? 0x4E00 : 0x3041;
        const size_t span = base == 0x4E00 ? 0x9FA5 - 0x4E00 : 0x30FF - 0x3041;
        for (size_t k = rng_.between(20, 400); k > 0; --k)
          p += utf8(base + char32_t(rng_.below(span)));
      }
    }
    return p + "\n";
  }

  std::string multilingual() {
    std::string p = rng_.pick(multilingual_);
    if (rng_.percent(40)) p += " " + rng_.pick(english_);
    if (rng_.percent(30)) p += rng_.pick(chinese_);
    return p + "\n";
  }

  std::string identifier() {
    std::string id = made_up_word();
    for (size_t n = rng_.below(3); n > 0; --n) {
      std::string w = made_up_word();
      if (rng_.percent(50)) {
        id += "_" + w;
      } else {
        w[0] = char(w[0] >= 'a' && w[0] <= 'z' ? w[0] - 'a' + 'A' : w[0]);
        id += w;
      }
    }
    if (rng_.percent(20)) id += std::to_string(rng_.below(100));
    return id;
  }

  std::string code() {
    std::string block = rng_.pick(code_);
    if (rng_.percent(30)) {  // re-indent with tabs
      std::string t;
      for (size_t i = 0; i < block.size();) {
        if (block.compare(i, 4, "    ") == 0 &&
            (i == 0 || block[i - 1] == '\n' || block[i - 1] == '\t')) {
          t += '\t';
          i += 4;
        } else {
          t += block[i++];
        }
      }
      block = t;
    }
    std::string extra;
    for (size_t n = rng_.below(6); n > 0; --n) {
      const uint64_t bits = rng_.next();
      char hex[32];
      std::snprintf(hex, sizeof hex, "0x%llX",
                    static_cast<unsigned long long>(bits >> rng_.below(60)));
      Text line;
      line << std::string(rng_.below(3) * 4, ' ') << "auto " << identifier() << " = "
           << (rng_.percent(50) ? std::string(hex) : std::to_string(rng_.below(1u << 20)))
           << ";  // " << sentence() << "\n";
      extra += line.s;
    }
    return extra + block + (rng_.percent(70) ? "\n" : "\n\n\n");
  }

  std::string markdown() {
    Text s;
    switch (rng_.below(6)) {
      case 0:
        s << std::string(rng_.between(1, 4), '#') << " " << sentence() << "\n\n";
        break;
      case 1:
        for (size_t n = rng_.between(2, 6); n > 0; --n)
          s << (rng_.percent(50) ? "- " : std::to_string(n) + ". ") << sentence() << "\n";
        break;
      case 2:
        s << "| " << made_up_word() << " | " << made_up_word() << " |\n| :--- | ---: |\n";
        for (size_t n = rng_.between(1, 5); n > 0; --n)
          s << "| **" << rng_.pick(words_) << "** | " << std::to_string(rng_.below(10000))
            << " |\n";
        break;
      case 3:
        s << "See [" << made_up_word() << "](https://example.org/" << identifier()
          << "?q=" << std::to_string(rng_.below(1000)) << "&lang=en#sec-"
          << std::to_string(rng_.below(9)) << ") or mail " << identifier()
          << "@example.com, and run `" << identifier() << " --" << made_up_word() << "="
          << std::to_string(rng_.below(64)) << "`.\n";
        break;
      case 4:
        s << "> " << sentence() << "\n> " << rng_.pick(chinese_) << "\n\n";
        break;
      default:
        s << "```\n" << rng_.pick(code_) << "```\n";
        break;
    }
    return s;
  }

  std::string emoji_item() {
    static const std::vector<char32_t> skin_base = {0x1F44B, 0x1F44D, 0x1F64F,
                                                    0x1F9D1, 0x1F466, 0x270C};
    static const std::vector<char32_t> newer = {
        // Unicode 15.0 and 16.0 emoji
        0x1FAE8, 0x1FA77, 0x1FABC, 0x1FACE, 0x1FABF, 0x1FADA, 0x1FADB, 0x1FAAD, 0x1FAAE,
        0x1FAAF, 0x1FAE9, 0x1FAC6, 0x1FABE, 0x1FADC, 0x1FA89, 0x1FA8F, 0x1FADF};
    switch (rng_.below(9)) {
      case 0:
        return utf8(char32_t(0x1F600 + rng_.below(0x50)));
      case 1:
        return utf8(char32_t(0x1F300 + rng_.below(0x300)));
      case 2:
        return utf8(char32_t(0x1F900 + rng_.below(0x100)));
      case 3:
        return Text() << utf8(rng_.pick(skin_base)) << utf8(char32_t(0x1F3FB + rng_.below(5)));
      case 4: {
        static const std::vector<std::string> zwj = {
            utf8({0x1F468, 0x200D, 0x1F469, 0x200D, 0x1F467, 0x200D, 0x1F466}),
            utf8({0x1F3F3, 0xFE0F, 0x200D, 0x1F308}), utf8({0x1F9D1, 0x200D, 0x1F4BB}),
            utf8({0x1F469, 0x1F3FD, 0x200D, 0x1F52C}), utf8({0x2764, 0xFE0F, 0x200D, 0x1F525})};
        return rng_.pick(zwj);
      }
      case 5:
        return Text() << utf8(char32_t(0x1F1E6 + rng_.below(26)))
                      << utf8(char32_t(0x1F1E6 + rng_.below(26)));
      case 6:
        return std::string(1, "0123456789#*"[rng_.below(12)]) + utf8({0xFE0F, 0x20E3});
      case 7:
        return Text() << utf8(char32_t(0x2600 + rng_.below(0x1C0)))
                      << (rng_.percent(50) ? utf8(0xFE0F) : "");
      default:
        return utf8(rng_.pick(newer));
    }
  }

  std::string emoji() {
    std::string out;
    for (const std::string& w : split(sentence(), " ")) {
      if (!out.empty()) out += " ";
      out += w;
      if (rng_.percent(30)) {
        std::string e = emoji_item();
        for (size_t n = rng_.percent(20) ? rng_.between(2, 6) : 1; n > 0; --n)
          out += (rng_.percent(50) ? "" : " ") + e;
      }
    }
    return out + (rng_.percent(50) ? "\n" : " ");
  }

  std::string digits(size_t n, char32_t zero) {
    std::string s;
    for (size_t i = 0; i < n; ++i) s += utf8(char32_t(zero + rng_.below(10)));
    return s;
  }

  std::string number() {
    static const std::vector<char32_t> zeros = {0x0660, 0x06F0,  0x0966, 0x09E6, 0x0E50,
                                                0xFF10, 0x1D7CE, 0x1040, 0x0AE6, 0x11F50};
    auto ascii = [&](size_t n) { return digits(n, '0'); };
    auto up_to = [&](size_t n) { return std::to_string(rng_.below(n)); };
    Text t;
    switch (rng_.below(14)) {
      case 0:
        t << ascii(rng_.between(1, 40));
        break;
      case 1:
        t << ascii(rng_.between(1, 6)) << "." << ascii(rng_.between(1, 9));
        break;
      case 2:
        t << "-" << ascii(rng_.between(1, 5)) << "e-" << ascii(rng_.between(1, 2));
        break;
      case 3:
        t << ascii(rng_.between(1, 3));
        for (size_t n = rng_.between(1, 4); n > 0; --n) t << "," << ascii(3);
        break;
      case 4:
        t << "2026-" << ascii(2) << "-" << ascii(2) << "T" << ascii(2) << ":" << ascii(2) << ":"
          << ascii(2) << "." << ascii(3) << "Z";
        break;
      case 5:
        t << up_to(256) << "." << up_to(256) << "." << up_to(256) << "." << up_to(256);
        break;
      case 6:
        t << "v" << up_to(20) << "." << up_to(100) << "." << up_to(1000) << "-rc." << up_to(9);
        break;
      case 7:
        t << "+44 20 " << ascii(4) << " " << ascii(4);
        break;
      case 8:
        t << rng_.pick(std::vector<std::string>{"$", "€", "¥", "£", "₹"})
          << ascii(rng_.between(1, 7)) << "." << ascii(2);
        break;
      case 9: {
        const size_t n = rng_.between(1, 12);
        t << digits(n, rng_.pick(zeros));
        break;
      }
      case 10:
        t << ascii(2) << digits(2, rng_.pick(zeros)) << ascii(2);
        break;
      case 11:
        t << utf8(char32_t(0x00BC + rng_.below(3))) << utf8(char32_t(0x2160 + rng_.below(12)))
          << utf8(char32_t(0x2460 + rng_.below(20)));
        break;
      case 12:
        t << "x" << utf8(char32_t(0x00B2)) << "+" << ascii(1) << "%";
        break;
      default:
        t << "0x" << std::string(1, "0123456789ABCDEF"[rng_.below(16)])
          << ascii(rng_.between(1, 10));
        break;
    }
    return t;
  }

  std::string numbers() {
    static const std::vector<std::string> seps = {" ", ", ",  "; ", "\t", " + ", "=",
                                                  "/", " | ", "\n", "",   " x ", "..."};
    std::string s;
    for (size_t n = rng_.between(5, 15); n > 0; --n) {
      s += number();
      s += rng_.pick(seps);
    }
    if (rng_.percent(30)) s += sentence();
    return s + "\n";
  }

  std::string whitespace_run() {
    static const std::vector<std::string> ws = {
        " ",          " ",          " ",          "\t",         "\n",         "\r\n",
        "\r",         utf8(0x00A0), utf8(0x3000), utf8(0x2028), utf8(0x2029), utf8(0x180E),
        utf8(0x200B), utf8(0x0085), "\x0B",       "\x0C",       utf8(0x2003), utf8(0x202F),
        utf8(0x205F), utf8(0x1680), utf8(0xFEFF)};
    size_t n;
    const size_t p = rng_.below(100);
    if (p < 70)
      n = rng_.between(1, 3);
    else if (p < 90)
      n = rng_.between(4, 20);
    else if (p < 99)
      n = rng_.between(21, 200);
    else
      n = rng_.between(500, 3000);
    std::string s;
    const bool uniform = rng_.percent(50);
    const std::string& one = rng_.pick(ws);
    for (size_t i = 0; i < n; ++i) s += uniform ? one : rng_.pick(ws);
    return s;
  }

  std::string whitespace() {
    std::string s = rng_.percent(30) ? whitespace_run() : "";
    for (size_t n = rng_.between(3, 12); n > 0; --n) {
      s += rng_.percent(70) ? rng_.pick(words_) : rng_.percent(50) ? number() : rng_.pick(chinese_);
      s += whitespace_run();
    }
    return s;
  }

  std::string added_in_context(const std::string& tok) {
    auto chars = characters(tok);
    switch (rng_.below(12)) {
      case 0:
        return Text() << made_up_word() << tok << rng_.pick(words_) << " ";
      case 1:
        return " " + tok + " ";
      case 2:
        return tok + rng_.pick(added_);
      case 3:
        return "\n" + tok + "\n\n";
      case 4: {  // near miss: one character short, at either end
        std::string s;
        const size_t from = rng_.percent(50) ? 1 : 0;
        for (size_t i = from; i + 1 - from < chars.size(); ++i) s += chars[i];
        return s + rng_.pick(words_);
      }
      case 5: {  // ASCII '|' for the full-width bar
        std::string s;
        for (const std::string& c : chars) s += c == "｜" ? "|" : c;
        return s + " ";
      }
      case 6:
        return "<｜DSML｜parameter name=\"" + made_up_word() + "\" string=\"true\">" + tok +
               "</｜DSML｜parameter>\n";
      case 7:
        return Text() << digits(3, '0') << tok << digits(4, '0');
      case 8:
        return rng_.pick(chinese_).substr(0, 9) + tok;
      case 9:
        return tok + tok;
      case 10:
        return "\t" + tok + whitespace_run();
      default:
        return tok;
    }
  }

  std::string added_tokens() {
    std::string s;
    for (size_t n = rng_.between(5, 30); n > 0; --n) {
      s += added_in_context(rng_.pick(added_));
      if (rng_.percent(20)) s += sentence();
    }
    return s;
  }

  std::string invalid_utf8() {
    static const std::vector<std::string> bad = {"\x80",
                                                 "\xBF",
                                                 "\x80\x80\x80",
                                                 "\xC0\xAF",
                                                 "\xC1\xBF",
                                                 "\xE0\x80\xAF",
                                                 "\xF0\x80\x80\xAF",
                                                 "\xED\xA0\x80",
                                                 "\xED\xBF\xBF",
                                                 "\xF4\x90\x80\x80",
                                                 "\xF5",
                                                 "\xFF",
                                                 "\xFE\xFE",
                                                 "\xE4\xB8",
                                                 "\xF0\x9F\x98",
                                                 "\xC3",
                                                 "\xE2\x82",
                                                 "\xF0\x9F",
                                                 "\xC2\x41"};
    static const std::vector<std::string> sources = {"english",      "chinese", "emoji",
                                                     "multilingual", "code",    "numbers"};
    std::string s = unit(rng_.pick(sources));
    for (size_t n = rng_.between(1, 4); n > 0; --n) {
      const size_t at = rng_.below(s.size() + 1);  // may land inside a character
      std::string b;
      if (rng_.percent(75)) {
        b = rng_.pick(bad);
      } else {
        for (size_t k = rng_.between(1, 8); k > 0; --k) b += char(0x80 + rng_.below(0x80));
      }
      s.insert(at, b);
    }
    if (rng_.percent(10) && s.size() > 2) s.erase(rng_.below(s.size()), 1);  // cut a character
    return s;
  }

  std::string random_unicode() {
    static const std::vector<std::pair<char32_t, char32_t>> interesting = {
        {0x0300, 0x036F}, {0x1100, 0x11FF}, {0x0600, 0x06FF}, {0x0900, 0x097F},
        {0x0E00, 0x0E7F}, {0x0F00, 0x0FFF}, {0x1800, 0x18AF}, {0x200B, 0x200F},
        {0x202A, 0x202E}, {0x2060, 0x2064}, {0xFE00, 0xFE0F}, {0xE0000, 0xE007F},
        {0xE000, 0xE0FF}, {0xFDD0, 0xFDEF}, {0xFFF0, 0xFFFF}, {0x0000, 0x001F},
        {0x007F, 0x009F}, {0x2000, 0x206F}, {0x3000, 0x303F}, {0x1F000, 0x1FAFF}};
    std::string s;
    for (size_t w = rng_.between(3, 12); w > 0; --w) {
      for (size_t n = rng_.between(1, 8); n > 0; --n) {
        char32_t cp;
        const size_t p = rng_.below(10);
        if (p < 5)
          cp = char32_t(rng_.below(0x110000));
        else if (p < 8)
          cp = char32_t(rng_.below(0x10000));
        else {
          const auto& r = rng_.pick(interesting);
          cp = r.first + char32_t(rng_.below(r.second - r.first + 1));
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD;  // surrogates are not scalar values
        s += utf8(cp);
      }
      s += rng_.pick(std::vector<std::string>{" ", " ", "", "\n", ".", ", ", "-", "  "});
    }
    return s;
  }

  std::string mixed() {
    static const std::vector<std::string> kinds = {
        "english", "chinese", "multilingual", "code",         "markdown",
        "emoji",   "numbers", "whitespace",   "added_tokens", "unicode"};
    return unit(rng_.pick(kinds));
  }

  Random rng_;
  std::vector<std::string> added_, english_, chinese_, multilingual_, code_, words_;
};

}  // namespace

CorpusSeeds CorpusSeeds::load(const std::string& dir) {
  auto read = [&](const char* name) {
    std::ifstream is(dir + "/" + name, std::ios::binary);
    DSV4_CHECK(is.good(), dir, "/", name, ": cannot open corpus seed text");
    std::ostringstream ss;
    ss << is.rdbuf();
    return ss.str();
  };
  return {read("english.txt"), read("chinese.txt"), read("multilingual.txt"), read("code.txt")};
}

std::vector<CorpusDocument> make_corpus(const CorpusSeeds& seeds,
                                        const std::vector<std::string>& added_tokens,
                                        uint64_t seed) {
  DSV4_CHECK(!added_tokens.empty(), "corpus: no added tokens given");
  static const std::vector<std::pair<std::string, int>> plan = {
      {"english", 6},      {"chinese", 5},      {"multilingual", 3}, {"code", 6},
      {"markdown", 3},     {"emoji", 3},        {"numbers", 3},      {"whitespace", 3},
      {"added_tokens", 3}, {"invalid_utf8", 3}, {"unicode", 3},      {"mixed", 5}};
  Generator gen(seeds, added_tokens, seed);
  std::vector<CorpusDocument> docs;
  for (const auto& [kind, count] : plan) {
    for (int i = 0; i < count; ++i) {
      CorpusDocument d{kind + "-" + std::to_string(i), ""};
      if (kind == "added_tokens") d.text = gen.all_added_tokens();
      while (d.text.size() < kDocumentBytes) d.text += gen.unit(kind);
      docs.push_back(std::move(d));
    }
  }
  return docs;
}

void write_corpus_file(const std::vector<CorpusDocument>& docs, const std::string& path) {
  std::ofstream os(path, std::ios::binary);
  DSV4_CHECK(os.good(), path, ": cannot write corpus file");
  auto put = [&](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) os.put(char((v >> (8 * i)) & 0xFF));
  };
  for (const CorpusDocument& d : docs) {
    put(d.name.size(), 4);
    os.write(d.name.data(), std::streamsize(d.name.size()));
    put(d.text.size(), 8);
    os.write(d.text.data(), std::streamsize(d.text.size()));
  }
  DSV4_CHECK(os.good(), path, ": write failed");
}

std::string seed_dir() {
  return std::string(DSV4_SOURCE_DIR) + "/tests/tokenizer/data/seed";
}

}  // namespace dsv4::tok::test
