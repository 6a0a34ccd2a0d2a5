#include "args.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <limits>

#include "core/error.h"

namespace dsv4::cli {
namespace {

int64_t to_int(const std::string& s, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  DSV4_CHECK(!s.empty() && end && *end == '\0' && errno == 0, what, ": '", s,
             "' is not an integer");
  return v;
}

}  // namespace

Args::Args(const std::vector<std::string>& argv, const std::set<std::string>& valued,
           const std::set<std::string>& switches) {
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    std::string flag = a, value;
    bool inline_value = false;
    if (auto eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      flag = a.substr(0, eq);
      value = a.substr(eq + 1);
      inline_value = true;
    }
    if (valued.count(flag)) {
      if (!inline_value) {
        DSV4_CHECK(i + 1 < argv.size(), "flag ", flag, " needs a value");
        value = argv[++i];
      }
      DSV4_CHECK(!values_.count(flag), "flag ", flag, " given twice");
      values_[flag] = value;
    } else if (switches.count(flag) && !inline_value) {
      switches_on_.insert(flag);
    } else {
      throw Error(cat("unknown argument '", a, "'"));
    }
  }
}

bool Args::has(const std::string& flag) const {
  return values_.count(flag) || switches_on_.count(flag);
}

std::string Args::str(const std::string& flag) const {
  auto it = values_.find(flag);
  DSV4_CHECK(it != values_.end(), "missing required flag ", flag);
  return it->second;
}

std::optional<std::string> Args::opt(const std::string& flag) const {
  auto it = values_.find(flag);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

int64_t Args::integer(const std::string& flag, int64_t fallback) const {
  auto v = opt(flag);
  return v ? to_int(*v, flag) : fallback;
}

uint64_t Args::unsigned_integer(const std::string& flag, uint64_t fallback) const {
  auto v = opt(flag);
  if (!v) return fallback;
  errno = 0;
  char* end = nullptr;
  const unsigned long long r = std::strtoull(v->c_str(), &end, 10);
  DSV4_CHECK(!v->empty() && (*v)[0] != '-' && end && *end == '\0' && errno == 0, flag, ": '", *v,
             "' is not a non-negative integer");
  return r;
}

double Args::number(const std::string& flag, double fallback) const {
  auto v = opt(flag);
  if (!v) return fallback;
  errno = 0;
  char* end = nullptr;
  const double r = std::strtod(v->c_str(), &end);
  DSV4_CHECK(!v->empty() && end && *end == '\0' && errno == 0, flag, ": '", *v,
             "' is not a number");
  return r;
}

std::vector<int32_t> parse_ids(const std::string& text, const std::string& what) {
  std::vector<int32_t> ids;
  size_t start = 0;
  DSV4_CHECK(!text.empty(), what, " is empty");
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string item =
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const int64_t v = to_int(item, what);
    DSV4_CHECK(v >= 0 && v <= std::numeric_limits<int32_t>::max(), what, ": token id ", v,
               " is negative or too large");
    ids.push_back(static_cast<int32_t>(v));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return ids;
}

std::vector<int32_t> read_id_file(const std::string& path) {
  std::ifstream is(path);
  DSV4_CHECK(is.good(), path, ": cannot open prompt file");
  std::vector<int32_t> ids;
  std::string line;
  int lineno = 0;
  while (std::getline(is, line)) {
    ++lineno;
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t'))
      line.pop_back();
    size_t b = line.find_first_not_of(" \t");
    if (b == std::string::npos) continue;
    const int64_t v = to_int(line.substr(b), cat(path, ":", lineno));
    DSV4_CHECK(v >= 0 && v <= std::numeric_limits<int32_t>::max(), path, ":", lineno, ": token id ",
               v, " is negative or too large");
    ids.push_back(static_cast<int32_t>(v));
  }
  DSV4_CHECK(!ids.empty(), path, ": no token ids");
  return ids;
}

}  // namespace dsv4::cli
