// The dsv4 command line: each command declares its flags once (Flag); that list is what Args
// accepts, what `dsv4 COMMAND --help` prints and where defaults, choices and numeric ranges
// come from, so help cannot drift from parsing. Errors are dsv4::Error naming the flag and
// quoting at most a short excerpt of the bad value.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4::cli {

struct Flag {
  std::string name{};      // "--max-new-tokens"
  std::string value{};     // the value's placeholder in help ("N", "DIR"); "" for a switch
  std::string help{};      // one line
  std::string fallback{};  // the default value ("" = none)
  bool required = false;   // must be given
  std::vector<std::string> choices{};                     // the accepted values (empty: any)
  double min = -std::numeric_limits<double>::infinity();  // numeric range (integer / number)
  double max = std::numeric_limits<double>::infinity();

  bool is_switch() const { return value.empty(); }
  bool has_range() const { return min > -std::numeric_limits<double>::infinity(); }
};

class Args;

struct Command {
  std::string name{};     // "generate"
  std::string summary{};  // one line for `dsv4 --help`
  std::string usage{};    // "dsv4 generate --model DIR ... [flags]"
  std::string about{};    // what it prints or writes (a few lines, may be empty)
  std::vector<Flag> flags{};
  int (*run)(const Args& args) = nullptr;
};

// The help text of a command (stdout of `dsv4 COMMAND --help`).
std::string command_help(const Command& c);
// "(default: 32; range [0, 16777216])", "(required)", "" ...: what help prints after a flag.
std::string flag_notes(const Flag& f);

class Args {
 public:
  // Parses argv against the command's flags: every flag must be declared, a valued flag must
  // have a value (next argument or --flag=value), none may be given twice; required flags must
  // be present and values of flags with choices must be among them.
  Args(const std::vector<std::string>& argv, const std::vector<Flag>& flags);

  bool has(const std::string& flag) const;  // given on the command line
  // The value given, else the flag's default; throws "missing required flag" when neither.
  std::string str(const std::string& flag) const;
  std::optional<std::string> opt(const std::string& flag) const;  // the value given, if any
  // The value (or default) as a number within the flag's range.
  int64_t integer(const std::string& flag) const;
  uint64_t unsigned_integer(const std::string& flag) const;
  double number(const std::string& flag) const;

  const std::vector<Flag>& flags() const { return flags_; }

 private:
  const Flag& declared(const std::string& flag) const;
  std::vector<Flag> flags_;
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_on_;
};

// Token ids as every command takes them: decimal integers separated by commas, with optional
// spaces or tabs around each ("0,17,42" or "0, 17, 42"). `what` names the source in errors.
std::vector<int32_t> parse_ids(std::string_view text, const std::string& what);
// A prompt file: the same comma-separated ids on one or more lines (blank lines ignored), so
// one id per line and `dsv4 tokenize`'s output both work.
std::vector<int32_t> read_id_file(const std::string& path);

}  // namespace dsv4::cli
