// A small TCP rendezvous for the processes of a parallel run (one per node, or several on one
// host): rank 0 listens on master_addr:master_port, the others connect to it, and it relays
// small blobs — the NCCL unique id the ranks need to build their communicator, the ranks'
// descriptions, barriers. Not a data path: collectives run on NCCL (or in-process).
//
// Loopback is the default address; the tests run N processes on one host. Every call is a
// collective of all `world` ranks; a peer that does not come within the timeout, or goes away,
// is a dsv4::Error naming it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dsv4 {

struct RendezvousOptions {
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int world = 1;  // processes taking part
  int rank = 0;   // this process, 0 = the master
  double timeout_s = 60;
};

class Rendezvous {
 public:
  explicit Rendezvous(const RendezvousOptions& o);  // connects (rank 0: accepts everyone)
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  int rank() const { return o_.rank; }
  int world() const { return o_.world; }
  // Rank 0's `blob` on every rank (others pass anything).
  std::vector<uint8_t> broadcast(const std::vector<uint8_t>& blob);
  // Every rank's blob, in rank order.
  std::vector<std::vector<uint8_t>> all_gather(const std::vector<uint8_t>& blob);
  void barrier();

 private:
  RendezvousOptions o_;
  int listen_fd_ = -1;
  std::vector<int> peers_;  // rank 0: fd of rank r at r (0 unused); others: [0] = master
};

}  // namespace dsv4
