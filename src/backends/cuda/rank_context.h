// One rank of the CUDA backend's parallel engine: its place in the layout and the device
// communicators of the groups it belongs to (all outlive the rank's model).
#pragma once

#include "comm/device_communicator.h"
#include "model/parallel_layout.h"

namespace dsv4 {

struct CudaRankContext {
  const ParallelLayout* layout = nullptr;
  int rank = 0;                         // in the world
  DeviceCommunicator* tp = nullptr;     // this attention replica's tp ranks (heads split)
  DeviceCommunicator* group = nullptr;  // every rank of this dp group (same sequences)
  DeviceCommunicator* ep = nullptr;     // the ep ranks that together hold every expert once
};

}  // namespace dsv4
