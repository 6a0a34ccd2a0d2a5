// Device collectives between ranks that are threads of one process (several ranks on one GPU):
// a test and development facility, so the CUDA backend's parallel engine runs and is compared
// with one rank without several GPUs. Not a fast path: every collective meets the other ranks
// on the host (the in-process host communicator) to swap pointers and CUDA events, then each
// rank copies what it receives with cudaMemcpyAsync on its own stream after the senders'
// events, and no rank's stream moves on before every reader of its buffers is done. Not
// capturable into a CUDA graph (the meeting is on the host).
#pragma once

#include <memory>
#include <vector>

#include "comm/device_communicator.h"

namespace dsv4 {

// The n ranks' communicators; hand one to each thread. Streams may be on one device or on
// several of this process (cudaMemcpyAsync between devices).
std::vector<std::unique_ptr<DeviceCommunicator>> make_inproc_device_communicators(int n);

}  // namespace dsv4
