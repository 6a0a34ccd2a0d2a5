// Host collectives between ranks in several processes (the CPU backend's parallel engine
// across nodes; CI runs the processes on one host over loopback): a TCP connection between
// every pair of ranks, made once through the rendezvous, ranks of one process included (they
// talk over loopback too, so one code path serves every pair). The same Communicator as the
// in-process one, so the CPU model's collectives are unchanged and a run stays bit-identical
// to one rank: a collective only moves bytes, in rank order, and sums nothing.
//
// Every message carries its communicator's tag and sequence number, so ranks that disagree on
// which collective comes next fail with an error instead of reading each other's data. A peer
// that closes (its process died or its rank aborted) fails the collective at once; a peer that
// stays silent for `timeout_s` fails it with a timeout naming the peer.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace dsv4 {

class Rendezvous;

// Collective over the rendezvous' processes: the world's `world` ranks are spread evenly, the
// process of rendezvous rank p holding ranks [p * world / processes, (p + 1) * world /
// processes). Returns this process's ranks' world communicators, in rank order; hand one to
// each rank's thread. Setup (every pair's connection) must complete within `timeout_s`, which
// also bounds a collective's wait for a silent peer; a timeout is a dsv4::Error saying what was
// missing. `listen_backlog` > 0: the listen queue's length (tests; the default is ample, and
// setup needs no particular length: each process accepts on a thread while it connects).
std::vector<std::unique_ptr<Communicator>> make_tcp_communicators(Rendezvous& rendezvous, int world,
                                                                  double timeout_s,
                                                                  int listen_backlog = 0);

}  // namespace dsv4
