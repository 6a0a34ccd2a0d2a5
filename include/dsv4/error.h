// dsv4's one exception type: every failure a user can cause (bad input, damaged checkpoint,
// exhausted cache) is reported as a dsv4::Error with a one-line message that names the file,
// tensor, flag or limit at fault.
#pragma once

#include <stdexcept>
#include <string>

namespace dsv4 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace dsv4
