// A small TCP rendezvous for the processes of a parallel run (one per node, or several on one
// host): rank 0 listens on master_addr:master_port, the others connect to it, and it relays
// small blobs — the NCCL unique id the ranks need to build their communicator, the ranks'
// descriptions, barriers. It is also the multi-node control plane's channel: node 0 posts each
// step's description (broadcast) and gathers the results the other nodes owe it (gather).
// Not a data path for tensors: collectives run on NCCL, in-process, or comm/tcp_communicator.h.
//
// Loopback is the default address; the tests run N processes on one host. Every call is a
// collective of all `world` ranks; a peer that does not come within the timeout, or goes away,
// is a dsv4::Error naming it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"

namespace dsv4 {

// What a read from a peer throws when the peer reported a failure (Rendezvous::fail) instead
// of the expected blob; what() is the peer's message, verbatim.
class PeerFailed : public Error {
 public:
  explicit PeerFailed(const std::string& what) : Error(what) {}
};

struct RendezvousOptions {
  std::string master_addr = "127.0.0.1";  // an IPv4 address or a host name
  int master_port = 29500;
  int world = 1;  // processes taking part
  int rank = 0;   // this process, 0 = the master
  double timeout_s = 60;
  std::string peer_noun = "rank";  // how errors name a peer ("node 2 closed the connection")
  // Blobs go in pieces of at most this many bytes (any blob size passes; the receiver refuses
  // a piece over 1 GiB, a corrupt stream). Smaller only in tests.
  size_t max_piece_bytes = size_t(1) << 28;
};

class Rendezvous {
 public:
  explicit Rendezvous(const RendezvousOptions& o);  // connects (rank 0: accepts everyone)
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  int rank() const { return o_.rank; }
  int world() const { return o_.world; }
  // Rank 0's `blob` on every rank (others pass anything). `timeout_s` < 0: the options' timeout;
  // 0: wait without limit (a node waiting for node 0's next command while the server idles;
  // a peer that goes away is still an error at once).
  std::vector<uint8_t> broadcast(const std::vector<uint8_t>& blob, double timeout_s = -1);
  // Rank 0 gets every rank's blob in rank order (its own first); the others get nothing back.
  std::vector<std::vector<uint8_t>> gather(const std::vector<uint8_t>& blob, double timeout_s = -1);
  // Every rank's blob, in rank order.
  std::vector<std::vector<uint8_t>> all_gather(const std::vector<uint8_t>& blob);
  void barrier();
  // Watching peers while something else runs (the multi-node control plane during a step).
  // The peers (rank 0: every other rank; others: rank 0) with a message to read or whose
  // connection ended, after waiting up to `wait_s`.
  std::vector<int> readable(double wait_s);
  // Whether `peer`'s connection has ended (nothing consumed).
  bool closed(int peer);
  // Whether `peer`'s next message is a failure report (fail()) or its connection has ended
  // (nothing consumed; a report still arriving counts once its header is in).
  bool reported(int peer);
  // One blob from `peer` (rank 0: any rank; others: rank 0), as gather() reads them.
  std::vector<uint8_t> receive(int peer, double timeout_s = -1);
  // The IPv4 address this process is reached at by the others: rank 0's master_addr, else the
  // local address of its connection to rank 0 (the interface that routes to the master).
  std::string local_address() const;
  // Reports a failure to the peers (rank 0: every other rank; others: rank 0): their next read
  // from this rank, in any call, throws PeerFailed(why). Best effort (a peer gone is skipped);
  // then waits up to `linger_s` for the peers to hang up, so the report is read before this
  // process closes its connections.
  void fail(const std::string& why, double linger_s = 0);
  // Waits up to `linger_s` for every peer to hang up, discarding what they send (after fail()).
  void linger(double linger_s);
  // "rank 2" / "node 2" (RendezvousOptions::peer_noun).
  std::string name(int rank) const;

 private:
  void send_blob(int peer, const std::vector<uint8_t>& blob, double timeout_s);

  RendezvousOptions o_;
  int listen_fd_ = -1;
  std::vector<int> peers_;  // rank 0: fd of rank r at r (0 unused); others: [0] = master
};

}  // namespace dsv4
