// The TCP rendezvous with N processes on one host (loopback): every rank gets rank 0's blob,
// every rank's blobs in rank order, barriers; a missing peer is a timeout error, not a hang.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "comm/rendezvous.h"
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

}  // namespace
}  // namespace dsv4::test
