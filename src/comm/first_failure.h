// Which of the ranks' failures to report after a step: when one rank fails, the communicators
// abort and the others fail with "collective aborted"; the cause is the first other failure.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include "core/error.h"

namespace dsv4 {

// Whether `e` is a "collective aborted" consequence of another rank's failure.
inline bool is_collective_abort(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    return std::string(x.what()).find("collective aborted") != std::string::npos;
  } catch (...) {
  }
  return false;
}

// The first failure that is not a "collective aborted" consequence, else the first failure;
// null when no rank failed.
inline std::exception_ptr first_failure(const std::vector<std::exception_ptr>& errors) {
  std::exception_ptr first;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& x) {
      if (std::string(x.what()).find("collective aborted") == std::string::npos) return e;
    } catch (...) {
      return e;
    }
    if (!first) first = e;
  }
  return first;
}

}  // namespace dsv4
