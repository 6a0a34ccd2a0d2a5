// Ranks as threads of one process: a test and development facility (the CPU backend's
// parallel engine, and several ranks on one GPU). make_inproc_communicators(n) returns the n
// ranks' communicators; hand one to each thread. A collective copies from the other ranks'
// buffers directly between two barriers.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace dsv4 {

std::vector<std::unique_ptr<Communicator>> make_inproc_communicators(int n);

}  // namespace dsv4
