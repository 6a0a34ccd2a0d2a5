// Which of the ranks' failures to report after a step: when one rank fails, the communicators
// abort and the others fail with CollectiveAborted; the cause is the first other failure.
#pragma once

#include <exception>
#include <vector>

#include "comm/collective_aborted.h"

namespace dsv4 {

// Whether `e` is a consequence of another rank's failure (CollectiveAborted).
inline bool is_collective_abort(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const CollectiveAborted&) {
    return true;
  } catch (...) {
  }
  return false;
}

// The first failure that is not a CollectiveAborted consequence, else the first failure;
// null when no rank failed.
inline std::exception_ptr first_failure(const std::vector<std::exception_ptr>& errors) {
  std::exception_ptr first;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    if (!is_collective_abort(e)) return e;
    if (!first) first = e;
  }
  return first;
}

}  // namespace dsv4
