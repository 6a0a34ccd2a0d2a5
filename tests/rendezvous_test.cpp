// The TCP rendezvous with N processes on one host (loopback): every rank gets rank 0's blob,
// every rank's blobs in rank order, barriers; a missing peer is a timeout error, not a hang;
// blobs larger than a piece arrive whole; a failure report reaches the peers' next read.
// The TCP communicator over it (ranks as threads of several processes): gathers and
// all-to-alls in rank order, larger than a socket's buffers, splits, an aborting rank and a
// silent one; setup with a listen queue of one connection.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "comm/collective_aborted.h"
#include "comm/rendezvous.h"
#include "comm/tcp_communicator.h"
#include "core/error.h"

namespace dsv4::test {
namespace {

// A port for this run (loopback only; the pid spreads concurrent runs apart).
int test_port(int salt) {
  return 20000 + int((getpid() * 7 + salt * 131) % 20000);
}

std::vector<uint8_t> blob_of(int rank) {
  return std::vector<uint8_t>(size_t(3 + rank), uint8_t(10 + rank));
}

// What each rank checks; returns 0 when everything holds.
int run_rank(const RendezvousOptions& o) {
  try {
    Rendezvous r(o);
    const std::vector<uint8_t> id =
        r.broadcast(o.rank == 0 ? std::vector<uint8_t>{1, 2, 3, 4} : std::vector<uint8_t>{9});
    if (id != std::vector<uint8_t>{1, 2, 3, 4}) return 2;
    const auto all = r.all_gather(blob_of(o.rank));
    if (int(all.size()) != o.world) return 3;
    for (int k = 0; k < o.world; ++k)
      if (all[size_t(k)] != blob_of(k)) return 4;
    for (int k = 0; k < 3; ++k) r.barrier();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", o.rank, e.what());
    return 1;
  }
}

TEST(Rendezvous, NProcessesOnOneHost) {
  for (int world : {2, 4}) {
    RendezvousOptions o;
    o.master_port = test_port(world);
    o.world = world;
    o.timeout_s = 30;
    std::vector<pid_t> kids;
    for (int r = 1; r < world; ++r) {
      const pid_t pid = fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        RendezvousOptions mine = o;
        mine.rank = r;
        _exit(run_rank(mine));
      }
      kids.push_back(pid);
    }
    EXPECT_EQ(run_rank(o), 0) << "world " << world;
    for (pid_t k : kids) {
      int status = 0;
      ASSERT_EQ(waitpid(k, &status, 0), k);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
          << "world " << world << " child status " << status;
    }
  }
}

TEST(Rendezvous, AMissingPeerIsATimeoutError) {
  RendezvousOptions o;
  o.master_port = test_port(99);
  o.world = 2;
  o.timeout_s = 0.5;
  try {
    Rendezvous r(o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  o.rank = 1;
  o.master_port = test_port(98);
  EXPECT_THROW(Rendezvous{o}, Error);  // nobody listening
}

TEST(Rendezvous, BadOptionsAreErrors) {
  RendezvousOptions o;
  o.world = 2;
  o.rank = 2;
  EXPECT_THROW(Rendezvous{o}, Error);
  o.rank = 0;
  o.master_addr = "localhost.invalid";
  EXPECT_THROW(Rendezvous{o}, Error);
}

// Forks `processes - 1` children; process p runs body(p) (the parent p = 0). Returns whether
// every process returned 0 (children by exit status); a body that throws prints why and counts
// as 2.
template <typename F>
bool in_processes(int processes, F body) {
  auto run = [&](int p) {
    try {
      return body(p);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "process %d: %s\n", p, e.what());
      return 2;
    }
  };
  std::vector<pid_t> kids;
  for (int p = 1; p < processes; ++p) {
    const pid_t pid = fork();
    if (pid == 0) _exit(run(p));
    kids.push_back(pid);
  }
  bool ok = run(0) == 0;
  for (pid_t k : kids) {
    int status = 0;
    ok &= waitpid(k, &status, 0) == k && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

// `port`: chosen in the parent (test_port() depends on the pid).
RendezvousOptions tcp_options(int processes, int p, int port) {
  RendezvousOptions o;
  o.master_port = port;
  o.world = processes;
  o.rank = p;
  o.timeout_s = 30;
  return o;
}

// World rank w's checks on its communicator; 0 when all hold.
int tcp_rank_checks(Communicator& c) {
  const int w = c.rank(), W = c.size();
  const int32_t mine = 10 * w;
  std::vector<int32_t> all(static_cast<size_t>(W));
  c.all_gather(&mine, sizeof(mine), all.data());
  for (int r = 0; r < W; ++r)
    if (all[size_t(r)] != 10 * r) return 10;
  // Buffers of different sizes per pair, a few MB: both sides send more than a socket holds.
  auto bytes = [](int from, int to) { return size_t(from + 1) * size_t(to + 1) * 300000; };
  std::vector<std::vector<uint8_t>> send(static_cast<size_t>(W)), recv;
  for (int d = 0; d < W; ++d) send[size_t(d)].assign(bytes(w, d), uint8_t(w * 7 + d));
  c.all_to_all(send, recv);
  for (int s = 0; s < W; ++s)
    if (recv[size_t(s)] != std::vector<uint8_t>(bytes(s, w), uint8_t(s * 7 + w))) return 11;
  // Split by parity, ordered by -rank: the higher rank first.
  std::unique_ptr<Communicator> half = c.split(w % 2, -w);
  if (half->size() != W / 2 || half->rank() != (W / 2 - 1 - w / 2)) return 12;
  const int32_t me = w;
  std::vector<int32_t> members(static_cast<size_t>(half->size()));
  half->all_gather(&me, sizeof(me), members.data());
  for (int k = 0; k < half->size(); ++k)
    if (members[size_t(k)] != W - 2 + w % 2 - 2 * k) return 13;
  half->barrier();
  c.barrier();
  return 0;
}

TEST(TcpCommunicator, RanksAsThreadsOfSeveralProcesses) {
  for (int processes : {2, 4}) {
    const int port = test_port(200 + processes);
    const bool ok = in_processes(processes, [&](int p) {
      Rendezvous rv(tcp_options(processes, p, port));
      std::vector<std::unique_ptr<Communicator>> comms = make_tcp_communicators(rv, 4, 30);
      if (int(comms.size()) != 4 / processes || comms[0]->rank() != p * (4 / processes)) return 20;
      std::vector<int> rc(comms.size(), -1);
      std::vector<std::thread> threads;
      for (size_t l = 0; l < comms.size(); ++l)
        threads.emplace_back([&, l] {
          try {
            rc[l] = tcp_rank_checks(*comms[l]);
          } catch (const std::exception& e) {
            std::fprintf(stderr, "rank %d: %s\n", comms[l]->rank(), e.what());
            rc[l] = 1;
          }
        });
      for (std::thread& t : threads) t.join();
      for (int x : rc)
        if (x) return x;
      return 0;
    });
    EXPECT_TRUE(ok) << processes << " processes";
  }
}

// A blob goes in pieces (RendezvousOptions::max_piece_bytes; 256 MiB by default, here 1000
// bytes so that the test needs no GiB): blobs of many pieces, of a piece exactly and empty
// ones arrive whole, in every call.
TEST(Rendezvous, BlobsLargerThanAPieceArriveWhole) {
  const int port = test_port(500);
  auto blob = [](int rank, size_t n) {
    std::vector<uint8_t> b(n);
    for (size_t i = 0; i < n; ++i) b[i] = uint8_t(i * 31 + size_t(rank) * 7 + i / 251);
    return b;
  };
  const bool ok = in_processes(3, [&](int p) {
    RendezvousOptions o = tcp_options(3, p, port);
    o.max_piece_bytes = 1000;
    Rendezvous rv(o);
    for (size_t n : {size_t(10007), size_t(1000), size_t(2000), size_t(0), size_t(1)}) {
      if (rv.broadcast(p == 0 ? blob(0, n) : std::vector<uint8_t>{}) != blob(0, n)) return 10;
      const auto all = rv.all_gather(blob(p, n + size_t(p) * 999));
      for (int k = 0; k < 3; ++k)
        if (all[size_t(k)] != blob(k, n + size_t(k) * 999)) return 11;
      const auto got = rv.gather(blob(p, n * size_t(p + 1)));
      if (p == 0)
        for (int k = 0; k < 3; ++k)
          if (got[size_t(k)] != blob(k, n * size_t(k + 1))) return 12;
    }
    return 0;
  });
  EXPECT_TRUE(ok);
}

// Rank 1 reports a failure instead of its part of a gather: rank 0's gather throws PeerFailed
// with rank 1's words; rank 0 relays them and rank 2, waiting in a broadcast, reads them too.
TEST(Rendezvous, AFailureReportReachesThePeersNextRead) {
  const int port = test_port(600);
  const std::string why = "node 1 failed to start: no weights";
  const bool ok = in_processes(3, [&](int p) {
    Rendezvous rv(tcp_options(3, p, port));
    if (p == 1) {
      rv.fail(why);
      try {
        rv.broadcast({}, 10);  // rank 0's relay
      } catch (const PeerFailed& e) {
        return e.what() == why ? 0 : 22;
      }
      return 23;
    }
    try {
      if (p == 0) {
        rv.gather({});
      } else {
        rv.gather({});
        rv.broadcast({});
      }
      return 20;
    } catch (const PeerFailed& e) {
      if (e.what() != why) return 21;
    }
    if (p == 0) rv.fail(why, 10);
    return 0;
  });
  EXPECT_TRUE(ok);
}

// 8 ranks over 2 processes with listen queues of two connections: a process connecting before
// it accepts (its own 4 ranks' 6 pairs first) would wait on its own full queue until the
// connect timed out; setup accepts while it connects, so it completes and the communicators
// work.
TEST(TcpCommunicator, SetupNeedsNoListenQueue) {
  const int port = test_port(700);
  const bool ok = in_processes(2, [&](int p) {
    Rendezvous rv(tcp_options(2, p, port));
    std::vector<std::unique_ptr<Communicator>> comms = make_tcp_communicators(rv, 8, 30, 2);
    std::vector<int> rc(comms.size(), -1);
    std::vector<std::thread> threads;
    for (size_t l = 0; l < comms.size(); ++l)
      threads.emplace_back([&, l] {
        try {
          const int32_t me = comms[l]->rank();
          std::vector<int32_t> all(8);
          comms[l]->all_gather(&me, sizeof(me), all.data());
          rc[l] = 0;
          for (int k = 0; k < 8; ++k)
            if (all[size_t(k)] != k) rc[l] = 30;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: %s\n", comms[l]->rank(), e.what());
          rc[l] = 1;
        }
      });
    for (std::thread& t : threads) t.join();
    for (int x : rc)
      if (x) return x;
    return 0;
  });
  EXPECT_TRUE(ok);
}

TEST(TcpCommunicator, AnAbortingRankFailsTheOthersCollective) {
  const int port = test_port(300);
  const bool ok = in_processes(2, [&](int p) {
    Rendezvous rv(tcp_options(2, p, port));
    std::vector<std::unique_ptr<Communicator>> comms = make_tcp_communicators(rv, 2, 30);
    if (p == 1) {
      comms[0]->abort();  // rank 1 failed
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      return 0;
    }
    int32_t x = 0, all[2];
    try {
      comms[0]->all_gather(&x, sizeof(x), all);
    } catch (const CollectiveAborted&) {  // the type, not the wording, says "a consequence"
      return 0;
    } catch (const Error&) {
      return 3;
    }
    return 4;
  });
  EXPECT_TRUE(ok);
}

TEST(TcpCommunicator, ASilentPeerIsATimeoutNamingIt) {
  const int port = test_port(400);
  const bool ok = in_processes(2, [&](int p) {
    Rendezvous rv(tcp_options(2, p, port));
    std::vector<std::unique_ptr<Communicator>> comms = make_tcp_communicators(rv, 2, 0.5);
    if (p == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(3));  // never joins
      return 0;
    }
    int32_t x = 0, all[2];
    try {
      comms[0]->all_gather(&x, sizeof(x), all);
    } catch (const Error& e) {
      const std::string m = e.what();
      return m.find("timed out") != std::string::npos &&
                     m.find("waiting for rank 1") != std::string::npos
                 ? 0
                 : 3;
    }
    return 4;
  });
  EXPECT_TRUE(ok);
}

}  // namespace
}  // namespace dsv4::test
