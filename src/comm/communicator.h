// Collectives between the ranks of the parallel engine, on host memory (the CPU backend; the
// GPU backend's device collectives are comm/nccl_communicator.h). Every rank of a
// communicator calls the same collectives in the same order. Results are deterministic: data
// arrive in rank order and nothing is summed in an order that depends on timing, so a
// parallel run can be bit-identical to one rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace dsv4 {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual void barrier() = 0;
  // recv (size() * bytes) = every rank's send (bytes each, the same on every rank), in rank
  // order.
  virtual void all_gather(const void* send, size_t bytes, void* recv) = 0;
  // recv[r] = what rank r put in its send[rank()]; send has size() buffers of any size.
  virtual void all_to_all(const std::vector<std::vector<uint8_t>>& send,
                          std::vector<std::vector<uint8_t>>& recv) = 0;
  // A communicator of the ranks that pass the same `color`, ordered by (key, rank). Every rank
  // calls it (collective).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  // A rank that failed: every rank waiting in (or later entering) a collective of this
  // communicator or of any split from it throws dsv4::Error instead of waiting forever.
  virtual void abort() = 0;

  // Typed helpers.
  template <typename T>
  std::vector<T> all_gather(const std::vector<T>& mine) {
    std::vector<T> out(mine.size() * size_t(size()));
    all_gather(mine.data(), mine.size() * sizeof(T), out.data());
    return out;
  }
};

}  // namespace dsv4
