// Device collectives between GPU ranks on NCCL (PyPI's nvidia-nccl-cu13: its headers and
// library, found by CMake through the installed wheel). One communicator per GPU rank; the
// ranks may be threads of one process (dsv4's choice on one node: one engine, one address
// space, no IPC of the weights or the scheduler's state) or processes bootstrapped by
// comm/rendezvous.h (several nodes). Every call is enqueued on the given stream and is
// capturable into a CUDA graph (sizes are host-side and fixed at capture). NVLink multicast
// (NVLS) is kept off: NCCL_NVLS_ENABLE=0 is set before the communicator is made, whatever the
// environment says.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/device_communicator.h"

namespace dsv4 {

class NcclCommunicator final : public DeviceCommunicator {
 public:
  // A new unique id (on one rank; hand it to all, e.g. through Rendezvous::broadcast).
  static std::vector<uint8_t> unique_id();
  // Every rank of the world calls this with the same id; `device` is this rank's GPU.
  NcclCommunicator(const std::vector<uint8_t>& id, int world, int rank, int device);
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
  // ncclCommSplit (collective over this communicator's ranks).
  std::unique_ptr<DeviceCommunicator> split(int color, int key) override;
  // ncclCommAbort: pending collectives of this communicator end.
  void abort() override;

 private:
  struct Impl;
  NcclCommunicator(std::unique_ptr<Impl> impl, int world, int rank);
  std::unique_ptr<Impl> impl_;
  int world_ = 1, rank_ = 0;
};

}  // namespace dsv4
