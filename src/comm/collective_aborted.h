// The failure a rank sees when another rank's failure aborted the communicators it was waiting
// in: a consequence, not a cause. Its own type, so that whoever picks the error to report
// (comm/first_failure.h, the multi-node control plane) tells consequences from causes by type,
// not by a message's wording.
#pragma once

#include <string>

#include "core/error.h"

namespace dsv4 {

class CollectiveAborted : public Error {
 public:
  explicit CollectiveAborted(const std::string& what) : Error(what) {}
};

}  // namespace dsv4
