// One rank of the CPU backend's parallel engine: its place in the layout and the
// communicators of the groups it belongs to (all outlive the rank's model).
#pragma once

#include "comm/communicator.h"
#include "model/parallel_layout.h"

namespace dsv4 {

struct RankContext {
  const ParallelLayout* layout = nullptr;
  int rank = 0;                   // in the world
  Communicator* world = nullptr;  // every rank
  Communicator* tp = nullptr;     // this attention replica's tp ranks (same sequences, heads split)
  Communicator* group = nullptr;  // every rank of this dp group (same sequences): tp x replicas
  Communicator* ep = nullptr;     // the ep ranks that together hold every expert once
};

}  // namespace dsv4
