// Device collectives between ranks that are threads of one process, every rank on one GPU: a
// test and development facility, so the CUDA backend's parallel engine runs and is compared
// with one rank without several GPUs. Not a fast path: before an eager collective and around a
// graph launch every rank drains the device (cudaDeviceSynchronize) before the ranks meet, and a
// communicator's first eager collective on a rank first launches its three kernels with nothing
// to do (on one H200 a rank's first waiting kernel, launched right after its buffers were
// allocated and filled, sometimes never ran beside the others' without this). Each
// collective is three launches on the rank's stream and needs nothing from the host, so it is
// capturable into a CUDA graph (the parallel engine's decode graphs). Eagerly, the ranks also meet
// on the host before and after each collective, and a graph launch is bracketed by
// launch_barrier(): kernels here wait on the device for other ranks' launches, so no rank may start
// other host work while one of them depends on a launch not yet made (CUDA's lazy kernel loading
// may synchronise the context: run processes that use this with CUDA_MODULE_LOADING=EAGER, as
// parallel_cuda_test does, to rule that out entirely). The host meetings of eager collectives and
// of graph launches must not mix (a rank that captures or replays while another runs eagerly would
// pair the wrong ones): the parallel runner decides eager or graph for the whole world, step by
// step. The ranks share a table in mapped pinned host memory: a one-thread kernel publishes the
// rank's send buffer (address, offset and size per destination) and its collective count, then
// spins until every rank has published the same collective; a copy kernel reads each sender's part
// (its address from the table, so a graph replays with whatever buffers the senders use); a last
// one-thread kernel marks the rank's reads done and spins until every rank's are, so no send buffer
// is rewritten while read. A receiver whose expected sizes differ from what was sent copies nothing
// and sets the communicator's mismatch flag, which check_completed() reports once the stream has
// completed (the parallel runner checks after every step: a replayed graph's mismatch fails that
// step) and every later collective's call refuses; abort() releases every waiting kernel (their
// data are garbage; the failing step throws on its rank). A spinning kernel holds one warp of one
// SM while it waits; the ranks' other kernels never wait on one another, so they always find room
// to run. CUDA does not promise that kernels of different streams run at the same time, though: a
// kernel that waits longer than `timeout_s` gives up, records what it waited for and every
// rank's counters, and aborts the world; check_completed() and every later collective then
// throw that description instead of the process hanging.
#pragma once

#include <memory>
#include <vector>

#include "comm/device_communicator.h"

namespace dsv4 {

// The n ranks' communicators (1 <= n <= 32); hand one to each thread. Every rank's stream must
// be on the same GPU (a collective on another throws).
std::vector<std::unique_ptr<DeviceCommunicator>> make_inproc_device_communicators(
    int n, double timeout_s = 60.0);

}  // namespace dsv4
