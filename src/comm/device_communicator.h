// Collectives between GPU ranks on device memory, enqueued on a CUDA stream: what the CUDA
// backend's parallel engine exchanges (the tensor-parallel gathers, the MoE dispatch and
// combine, the data-parallel group's rows). Two implementations with this one interface:
// NcclCommunicator (comm/nccl_communicator.h: one GPU per rank, the real thing) and the
// in-process one (comm/inproc_device_communicator.h: ranks as threads, several on one GPU; a
// test and development facility). Every rank of a communicator calls the same collectives in
// the same order, each on its own stream; data arrive in rank order and nothing is summed, so
// what a collective moves is bit for bit what was sent.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace dsv4 {

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // recv [size() * bytes] = every rank's send [bytes], in rank order. send and recv must not
  // overlap.
  virtual void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) = 0;
  // This rank sends send_bytes[d] bytes at send + send_offset[d] to rank d and receives
  // recv_bytes[s] bytes from rank s at recv + recv_offset[s]; recv_bytes[s] must equal what s
  // sends here. Zero-byte entries move nothing (a rank without work still takes part).
  virtual void all_to_all_v(const void* send, const std::vector<size_t>& send_offset,
                            const std::vector<size_t>& send_bytes, void* recv,
                            const std::vector<size_t>& recv_offset,
                            const std::vector<size_t>& recv_bytes, cudaStream_t stream) = 0;
  // Every rank of the communicator calls it (host side) just before and just after launching a
  // CUDA graph that holds its collectives. The in-process communicator's collectives wait on
  // the device for the other ranks' launches; the barriers keep any rank's later host work (a
  // lazily loaded kernel may synchronise the whole context) from starting before every rank's
  // graph is launched. NCCL: nothing (one context per rank).
  virtual void launch_barrier() {}
  // Once the caller's stream has completed the collectives enqueued on this communicator so far
  // (a stream synchronised after a step): throws dsv4::Error if one of them failed in a way its
  // call could not report, because it ran without the host (replayed from a CUDA graph). The
  // in-process communicator: a receiver that expected other sizes than were sent to it (nothing
  // was copied; the parallel runner checks after every step, so such a step fails instead of
  // passing garbage on). NCCL: nothing to check here (its errors end in abort()).
  virtual void check_completed() {}
  // A communicator of the ranks that pass the same `color`, ordered by (key, rank). Every rank
  // calls it (collective).
  virtual std::unique_ptr<DeviceCommunicator> split(int color, int key) = 0;
  // A rank that failed: the others' pending and later collectives fail instead of waiting
  // forever (where the implementation can; NCCL aborts the communicator).
  virtual void abort() = 0;
};

}  // namespace dsv4
