// Device collectives between GPU ranks on NCCL (PyPI's nvidia-nccl-cu13: its headers and
// library, found by CMake through the installed wheel). One communicator per GPU rank; the
// ranks may be threads of one process (dsv4's choice on one node: one engine, one address
// space, no IPC of the weights or the scheduler's state) or processes bootstrapped by
// comm/rendezvous.h (several nodes). Every call is enqueued on the given stream and is
// capturable into a CUDA graph (sizes are host-side and fixed at capture). NVLink multicast
// (NVLS) is kept off: NCCL_NVLS_ENABLE=0 is set before the communicator is made, whatever the
// environment says.
//
// Set-up never hangs: NCCL's blocking init cannot be interrupted (a rank that never joins, or a
// node that fails after the others entered it, would leave every other rank waiting forever),
// so the world communicator is made non-blocking (ncclConfig_t::blocking = 0,
// ncclCommInitRankConfig) and its state is polled (ncclCommGetAsyncError) against a deadline and
// a cancel signal (NcclSetup); on either, or on an NCCL error, the communicator is aborted
// (ncclCommAbort) and the constructor throws, naming the cause. Splits of the world run the same
// way (a split of a non-blocking communicator is non-blocking; NCCL's ncclCommSplit returns
// ncclSuccess while its thread still makes the new communicator, so the parent's state is polled
// whatever a call on a non-blocking communicator returned). The communicators the splits
// make are blocking: NCCL launches every group of a non-blocking communicator from a new thread
// of its own (group.cc), a cost on every eager collective; a step that waits for a failed peer
// is ended by abort() instead (the control plane's watch, RankPool). Calls on the non-blocking
// world that answer ncclInProgress (a collective, a group) are waited for before they return.
// NCCL_COMM_BLOCKING, which would override both choices, is cleared from the environment.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/device_communicator.h"

namespace dsv4 {

// How a communicator's set-up (the world's init, each split) is bounded.
struct NcclSetup {
  // Seconds a set-up may take before it is aborted (every rank of the world must have joined
  // by then): an Error saying so. The ranks enter it together (on several nodes, after every
  // node confirmed it got there), so this only has to cover NCCL's own work.
  double timeout_s = 300;
  // Polled (from the rank's thread, often) while a set-up is in flight: true aborts it and the
  // set-up throws CollectiveAborted (another rank of this process failed, or the multi-node
  // control plane saw another node fail: a consequence, the cause is reported elsewhere).
  std::function<bool()> cancelled;
};

class NcclCommunicator final : public DeviceCommunicator {
 public:
  // A new unique id (on one rank; hand it to all, e.g. through Rendezvous::broadcast).
  static std::vector<uint8_t> unique_id();
  // Every rank of the world calls this with the same id; `device` is this rank's GPU. Returns
  // once every rank joined; throws (after aborting its communicator) when `setup` runs out or
  // is cancelled, or NCCL fails.
  NcclCommunicator(const std::vector<uint8_t>& id, int world, int rank, int device,
                   const NcclSetup& setup = {});
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return world_; }

  // recv [size() * bytes] = every rank's send [bytes], in rank order.
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) override;
  // In place, summed over the ranks (NCCL's order: not bit-stable across world sizes).
  void all_reduce_sum_f32(float* data, size_t count, cudaStream_t stream);
  // This rank sends send_bytes[d] bytes at send + send_offset[d] to rank d and receives
  // recv_bytes[s] bytes from rank s at recv + recv_offset[s] (a grouped send/recv).
  void all_to_all_v(const void* send, const std::vector<size_t>& send_offset,
                    const std::vector<size_t>& send_bytes, void* recv,
                    const std::vector<size_t>& recv_offset, const std::vector<size_t>& recv_bytes,
                    cudaStream_t stream) override;
  // ncclCommSplit (collective over this communicator's ranks), bounded by this communicator's
  // NcclSetup when it is the non-blocking world; a split of a split is a blocking call (the
  // engine splits only the world). The new communicator is blocking.
  std::unique_ptr<DeviceCommunicator> split(int color, int key) override;
  // ncclCommAbort: pending collectives of this communicator end. Any thread, any number of
  // times.
  void abort() override;
  // Whether collectives on this communicator are non-blocking NCCL calls (the world: yes).
  bool nonblocking() const;

 private:
  struct Impl;
  NcclCommunicator(std::unique_ptr<Impl> impl, int world, int rank);
  std::unique_ptr<Impl> impl_;
  int world_ = 1, rank_ = 0;
};

}  // namespace dsv4
