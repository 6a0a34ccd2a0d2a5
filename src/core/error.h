// Error reporting: every user-visible failure is a dsv4::Error with a one-line message
// that names the file, tensor or argument at fault.
#pragma once

#include <sstream>
#include <string>
#include <utility>

#include "../../include/dsv4/error.h"  // the public exception type

namespace dsv4 {

// Concatenates any streamable values into one string.
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

}  // namespace dsv4

// Throws dsv4::Error with the concatenated message when `cond` is false.
#define DSV4_CHECK(cond, ...)                                   \
  do {                                                          \
    if (!(cond)) throw ::dsv4::Error(::dsv4::cat(__VA_ARGS__)); \
  } while (0)
