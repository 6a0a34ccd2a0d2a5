// Strict command-line parsing for the dsv4 subcommands: every flag must be known, flags that
// take a value must have one, and malformed numbers are errors (dsv4::Error).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace dsv4::cli {

class Args {
 public:
  // `valued`: flags followed by a value; `switches`: flags without one.
  Args(const std::vector<std::string>& argv, const std::set<std::string>& valued,
       const std::set<std::string>& switches);

  bool has(const std::string& flag) const;
  std::string str(const std::string& flag) const;  // required
  std::optional<std::string> opt(const std::string& flag) const;
  int64_t integer(const std::string& flag, int64_t fallback) const;
  double number(const std::string& flag, double fallback) const;
  uint64_t unsigned_integer(const std::string& flag, uint64_t fallback) const;

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_on_;
};

// "1,2,3" -> ids; rejects empty items and non-integers.
std::vector<int32_t> parse_ids(const std::string& text, const std::string& what);
// One id per line (blank lines ignored).
std::vector<int32_t> read_id_file(const std::string& path);

}  // namespace dsv4::cli
