#include "args.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/excerpt.h"

namespace dsv4::cli {
namespace {

std::string number_text(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e18) return std::to_string(static_cast<long long>(v));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string range_text(const Flag& f) {
  return cat("[", number_text(f.min), ", ", number_text(f.max), "]");
}

std::string_view trim(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string_view::npos) return {};
  const size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

// One id of a comma-separated list (item `n`, 1-based, of `text`).
int32_t parse_id(std::string_view item, size_t n, std::string_view text, const std::string& what,
                 bool last) {
  const std::string_view v = trim(item);
  if (v.empty()) {
    if (last && n > 1) throw Error(cat(what, ": nothing after the last comma (trailing comma?)"));
    throw Error(cat(what, ": id ", n, " is empty",
                    n == 1 ? " (leading comma?)" : " (two commas in a row?)", " in ",
                    excerpt(text)));
  }
  bool digits = true;
  for (char c : v) digits &= c >= '0' && c <= '9';
  if (!digits) {
    bool negative = v.size() > 1 && v[0] == '-';
    for (char c : v.substr(1)) negative &= c >= '0' && c <= '9';
    DSV4_CHECK(!negative, what, ": token id ", excerpt(v), " is negative");
    const bool spaced = v.find_first_of(" \t") != std::string_view::npos;
    throw Error(cat(what, ": ", excerpt(v), " is not a token id",
                    spaced ? " (ids are separated by commas, not spaces)" : "",
                    " (non-negative integers separated by commas)"));
  }
  const size_t first = v.find_first_not_of('0');
  const std::string_view sig = first == std::string_view::npos ? "0" : v.substr(first);
  DSV4_CHECK(sig.size() <= 10 && std::stoll(std::string(sig)) <= INT32_MAX, what, ": token id ",
             excerpt(v), " is too large (at most 2147483647)");
  return static_cast<int32_t>(std::stoll(std::string(sig)));
}

void parse_list(std::string_view text, const std::string& what, std::vector<int32_t>& ids) {
  size_t start = 0, n = 1;
  while (true) {
    const size_t comma = text.find(',', start);
    const bool last = comma == std::string_view::npos;
    ids.push_back(parse_id(text.substr(start, last ? std::string_view::npos : comma - start), n,
                           text, what, last));
    if (last) break;
    start = comma + 1;
    ++n;
  }
}

}  // namespace

std::string flag_notes(const Flag& f) {
  std::vector<std::string> notes;
  if (f.required) notes.push_back("required");
  if (!f.fallback.empty()) notes.push_back("default: " + f.fallback);
  if (!f.choices.empty()) {
    std::string c = "one of ";
    for (size_t i = 0; i < f.choices.size(); ++i) c += (i ? ", " : "") + f.choices[i];
    notes.push_back(c);
  }
  if (f.has_range()) notes.push_back("range " + range_text(f));
  if (notes.empty()) return "";
  std::string s = "(";
  for (size_t i = 0; i < notes.size(); ++i) s += (i ? "; " : "") + notes[i];
  return s + ")";
}

std::string command_help(const Command& c) {
  std::string s = "usage: " + c.usage + "\n\n" + c.summary + ".\n";
  if (!c.about.empty()) s += c.about + "\n";
  s += "\nflags:\n";
  auto row = [&](const std::string& left, const std::string& text) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "  %-26s", left.c_str());
    s += buf;
    if (left.size() > 25) s += "\n" + std::string(28, ' ');
    s += text + "\n";
  };
  for (const Flag& f : c.flags) {
    const std::string notes = flag_notes(f);
    row(f.name + (f.is_switch() ? "" : " " + f.value), f.help + (notes.empty() ? "" : " " + notes));
  }
  row("-h, --help", "print this help and exit");
  return s;
}

Args::Args(const std::vector<std::string>& argv, const std::vector<Flag>& flags) : flags_(flags) {
  auto find = [&](const std::string& name) -> const Flag* {
    for (const Flag& f : flags_)
      if (f.name == name) return &f;
    return nullptr;
  };
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    std::string name = a, value;
    bool inline_value = false;
    if (auto eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
      inline_value = true;
    }
    const Flag* f = find(name);
    if (!f) {
      DSV4_CHECK(a.rfind("-", 0) == 0, "unexpected argument ", excerpt(a),
                 " (every value follows its flag; see --help)");
      throw Error(cat("unknown flag ", excerpt(name), " (see --help)"));
    }
    DSV4_CHECK(!values_.count(name) && !switches_on_.count(name), "flag ", name, " given twice");
    if (f->is_switch()) {
      DSV4_CHECK(!inline_value, "flag ", name, " takes no value");
      switches_on_.insert(name);
      continue;
    }
    if (!inline_value) {
      DSV4_CHECK(i + 1 < argv.size(), "flag ", name, " needs a value (", f->value, ")");
      value = argv[++i];
    }
    if (!f->choices.empty()) {
      bool ok = false;
      for (const std::string& c : f->choices) ok |= c == value;
      std::string list;
      for (const std::string& c : f->choices) list += (list.empty() ? "" : ", ") + c;
      DSV4_CHECK(ok, name, ": ", excerpt(value), " is not one of ", list);
    }
    values_[name] = value;
  }
  for (const Flag& f : flags_)
    DSV4_CHECK(!f.required || has(f.name), "missing required flag ", f.name, " (see --help)");
}

const Flag& Args::declared(const std::string& flag) const {
  for (const Flag& f : flags_)
    if (f.name == flag) return f;
  throw Error(cat("internal: flag ", flag, " is not declared by this command"));
}

bool Args::has(const std::string& flag) const {
  declared(flag);
  return values_.count(flag) || switches_on_.count(flag);
}

std::string Args::str(const std::string& flag) const {
  const Flag& f = declared(flag);
  if (auto it = values_.find(flag); it != values_.end()) return it->second;
  DSV4_CHECK(!f.fallback.empty(), "missing required flag ", flag);
  return f.fallback;
}

std::optional<std::string> Args::opt(const std::string& flag) const {
  declared(flag);
  auto it = values_.find(flag);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

int64_t Args::integer(const std::string& flag) const {
  const Flag& f = declared(flag);
  const std::string s = str(flag);
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  const bool parsed = !s.empty() && s[0] != ' ' && end && *end == '\0';
  DSV4_CHECK(parsed, flag, ": ", excerpt(s), " is not an integer");
  DSV4_CHECK(errno != ERANGE && double(v) >= f.min && double(v) <= f.max, flag, ": ", excerpt(s),
             " is out of range ", range_text(f));
  return v;
}

uint64_t Args::unsigned_integer(const std::string& flag) const {
  const std::string s = str(flag);
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  DSV4_CHECK(!s.empty() && s[0] >= '0' && s[0] <= '9' && end && *end == '\0', flag, ": ",
             excerpt(s), " is not a non-negative integer");
  DSV4_CHECK(errno != ERANGE, flag, ": ", excerpt(s), " is out of range [0, 18446744073709551615]");
  return v;
}

double Args::number(const std::string& flag) const {
  const Flag& f = declared(flag);
  const std::string s = str(flag);
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  DSV4_CHECK(!s.empty() && s[0] != ' ' && end && *end == '\0' && !std::isnan(v), flag, ": ",
             excerpt(s), " is not a number");
  DSV4_CHECK(!(errno == ERANGE && std::isinf(v)) && v >= f.min && v <= f.max, flag, ": ",
             excerpt(s), " is out of range ", range_text(f));
  return v;
}

std::vector<int32_t> parse_ids(std::string_view text, const std::string& what) {
  DSV4_CHECK(!trim(text).empty(), what, " is empty");
  std::vector<int32_t> ids;
  parse_list(text, what, ids);
  return ids;
}

std::vector<int32_t> read_id_file(const std::string& path) {
  DSV4_CHECK(!std::filesystem::is_directory(path), path, ": is a directory, not a prompt file");
  std::ifstream is(path, std::ios::binary);
  DSV4_CHECK(is.good(), path, ": cannot open prompt file");
  std::vector<int32_t> ids;
  std::string line;
  int lineno = 0;
  while (std::getline(is, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;
    parse_list(line, cat(path, ":", lineno), ids);
  }
  DSV4_CHECK(!is.bad(), path, ": read failed");
  DSV4_CHECK(!ids.empty(), path, ": no token ids");
  return ids;
}

}  // namespace dsv4::cli
