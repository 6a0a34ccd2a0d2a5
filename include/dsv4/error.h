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

// The engine cannot go on: a step failed in a way that leaves it unusable (a node of a
// multi-node run failed or went away, the parallel ranks' communicators aborted). The requests
// in flight fail with it and every later call throws it again; a server stops serving (/health
// 503) and exits non-zero. Restart the run (every node).
class EngineFailed : public Error {
 public:
  explicit EngineFailed(const std::string& what) : Error(what) {}
};

}  // namespace dsv4
