#include "comm/tcp_communicator.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "comm/collective_aborted.h"
#include "comm/rendezvous.h"
#include "core/error.h"

namespace dsv4 {
namespace {

using Clock = std::chrono::steady_clock;

const char kAborted[] = "a rank of the parallel engine failed (collective aborted)";

// One rank's connections to every other rank of the world (fd -1 at its own index); shared by
// the rank's communicator and everything split from it (only the rank's thread uses them).
struct Links {
  int rank = 0;
  std::vector<int> fds;
  double timeout_s = 600;
  std::atomic<bool> aborted{false};
  ~Links() {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
  }
};

// What precedes each message: which collective it belongs to and how many bytes follow.
struct Header {
  uint64_t tag = 0, seq = 0, bytes = 0;
};

// One transfer of a collective: `n` bytes to or from `peer`.
struct Transfer {
  int peer = 0;
  uint8_t* data = nullptr;
  size_t n = 0, done = 0;
};

// Moves every send and receive at once (non-blocking sockets polled together, so two ranks
// sending each other more than a socket buffer do not wait on each other).
void exchange(Links& L, std::vector<Transfer>& sends, std::vector<Transfer>& recvs) {
  if (L.aborted) throw CollectiveAborted(kAborted);
  auto last = Clock::now();
  for (;;) {
    std::vector<pollfd> p;
    std::vector<Transfer*> t;
    for (auto* list : {&sends, &recvs})
      for (Transfer& x : *list)
        if (x.done < x.n) {
          p.push_back({L.fds[size_t(x.peer)], short(list == &sends ? POLLOUT : POLLIN), 0});
          t.push_back(&x);
        }
    if (p.empty()) return;
    const int r = ::poll(p.data(), p.size(), 1000);
    if (L.aborted) throw CollectiveAborted(kAborted);
    if (r < 0) {
      DSV4_CHECK(errno == EINTR, "tcp communicator: poll: ", std::strerror(errno));
      continue;
    }
    if (r == 0) {
      const double idle = std::chrono::duration<double>(Clock::now() - last).count();
      if (idle > L.timeout_s) {
        throw Error(cat("tcp communicator: rank ", L.rank, " timed out after ", L.timeout_s,
                        " s waiting for rank ", t[0]->peer,
                        " in a collective (its node stalled or the ranks disagree on the step)"));
      }
      continue;
    }
    for (size_t i = 0; i < p.size(); ++i) {
      if (!p[i].revents) continue;
      Transfer& x = *t[i];
      const bool out = p[i].events == POLLOUT;
      const ssize_t k = out ? ::send(p[i].fd, x.data + x.done, x.n - x.done, MSG_NOSIGNAL)
                            : ::recv(p[i].fd, x.data + x.done, x.n - x.done, 0);
      if (k > 0) {
        x.done += size_t(k);
        last = Clock::now();
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      // The peer's process died or its rank aborted (it shuts its connections down).
      throw CollectiveAborted(
          cat("tcp communicator: rank ", x.peer, " went away (", kAborted, ")"));
    }
  }
}

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(std::shared_ptr<Links> links, std::vector<int> members, uint64_t tag)
      : links_(std::move(links)), members_(std::move(members)), tag_(tag) {
    rank_ = int(std::find(members_.begin(), members_.end(), links_->rank) - members_.begin());
  }

  int rank() const override { return rank_; }
  int size() const override { return int(members_.size()); }

  void barrier() override { all_gather(nullptr, 0, nullptr); }

  void all_gather(const void* send, size_t bytes, void* recv) override {
    std::vector<std::vector<uint8_t>> out(members_.size());
    const uint8_t* s = static_cast<const uint8_t*>(send);
    for (auto& b : out) b.assign(s, s + bytes);
    std::vector<std::vector<uint8_t>> in;
    all_to_all(out, in);
    for (int r = 0; r < size(); ++r) {
      DSV4_CHECK(in[size_t(r)].size() == bytes, "all_gather: rank ", r, " sends ",
                 in[size_t(r)].size(), " bytes, rank ", rank_, " ", bytes);
      if (bytes)
        std::memcpy(static_cast<uint8_t*>(recv) + size_t(r) * bytes, in[size_t(r)].data(), bytes);
    }
  }

  void all_to_all(const std::vector<std::vector<uint8_t>>& send,
                  std::vector<std::vector<uint8_t>>& recv) override {
    const int n = size();
    DSV4_CHECK(int(send.size()) == n, "all_to_all: ", send.size(), " buffers for ", n, " ranks");
    const uint64_t seq = seq_++;
    // Headers first (sizes), then the data.
    std::vector<Header> out(static_cast<size_t>(n)), in(static_cast<size_t>(n));
    std::vector<Transfer> sends, recvs;
    for (int r = 0; r < n; ++r) {
      if (r == rank_) continue;
      out[size_t(r)] = {tag_, seq, send[size_t(r)].size()};
      sends.push_back(
          {members_[size_t(r)], reinterpret_cast<uint8_t*>(&out[size_t(r)]), sizeof(Header), 0});
      recvs.push_back(
          {members_[size_t(r)], reinterpret_cast<uint8_t*>(&in[size_t(r)]), sizeof(Header), 0});
    }
    exchange(*links_, sends, recvs);
    recv.assign(size_t(n), {});
    sends.clear();
    recvs.clear();
    for (int r = 0; r < n; ++r) {
      if (r == rank_) {
        recv[size_t(r)] = send[size_t(r)];
        continue;
      }
      const Header& h = in[size_t(r)];
      DSV4_CHECK(h.tag == tag_ && h.seq == seq, "tcp communicator: rank ", members_[size_t(r)],
                 " is in another collective (communicator ", h.tag, " #", h.seq, ", expected ",
                 tag_, " #", seq, ")");
      DSV4_CHECK(h.bytes <= (uint64_t(1) << 40), "tcp communicator: rank ", members_[size_t(r)],
                 " announces ", h.bytes, " bytes");
      recv[size_t(r)].resize(size_t(h.bytes));
      if (h.bytes) recvs.push_back({members_[size_t(r)], recv[size_t(r)].data(), h.bytes, 0});
      if (!send[size_t(r)].empty())
        sends.push_back({members_[size_t(r)], const_cast<uint8_t*>(send[size_t(r)].data()),
                         send[size_t(r)].size(), 0});
    }
    exchange(*links_, sends, recvs);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const int32_t mine[2] = {color, key};
    std::vector<int32_t> all(size_t(2 * size()));
    all_gather(mine, sizeof(mine), all.data());
    std::vector<std::pair<int, int>> chosen;  // (key, world rank)
    for (int r = 0; r < size(); ++r)
      if (all[size_t(2 * r)] == color)
        chosen.emplace_back(all[size_t(2 * r + 1)], members_[size_t(r)]);
    std::sort(chosen.begin(), chosen.end());
    std::vector<int> members;
    for (const auto& c : chosen) members.push_back(c.second);
    // Every member derives the same tag: the parent's, the split's number and the color.
    const uint64_t tag =
        (tag_ * 0x9E3779B97F4A7C15ull) ^ (++splits_ << 20) ^ uint64_t(uint32_t(color));
    return std::make_unique<TcpCommunicator>(links_, std::move(members), tag);
  }

  void abort() override {
    links_->aborted = true;
    // Peers blocked on this rank see their connections end.
    for (int fd : links_->fds)
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
  }

 private:
  std::shared_ptr<Links> links_;
  std::vector<int> members_;  // world ranks, in this communicator's order
  uint64_t tag_;
  int rank_ = 0;
  uint64_t seq_ = 0, splits_ = 0;
};

void set_socket_options(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

sockaddr_in parse_address(const std::string& w) {
  const size_t sp = w.find(' ');
  sockaddr_in to{};
  to.sin_family = AF_INET;
  DSV4_CHECK(
      sp != std::string::npos && inet_pton(AF_INET, w.substr(0, sp).c_str(), &to.sin_addr) == 1,
      "tcp communicator: bad address '", w, "'");
  to.sin_port = htons(uint16_t(std::stoi(w.substr(sp + 1))));
  return to;
}

// Connects to `to` by `deadline`, retrying while the peer refuses or its listen queue is full
// (a non-blocking connect polled in slices, so a stalled handshake cannot outlive the deadline).
int connect_by(const sockaddr_in& to, Clock::time_point start, double timeout_s,
               const std::string& what) {
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    DSV4_CHECK(fd >= 0, "tcp communicator: socket: ", std::strerror(errno));
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    int err = 0;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        err = ETIMEDOUT;
        while (seconds_since(start) < timeout_s) {
          pollfd p{fd, POLLOUT, 0};
          if (::poll(&p, 1, 100) > 0) {
            socklen_t n = sizeof(err);
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &n);
            break;
          }
        }
      }
    }
    if (err == 0) {
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      return fd;
    }
    ::close(fd);
    DSV4_CHECK(seconds_since(start) < timeout_s, "tcp communicator: timed out after ", timeout_s,
               " s: ", what, " (last error: ", std::strerror(err), ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_tcp_communicators(Rendezvous& rv, int world,
                                                                  double timeout_s,
                                                                  int listen_backlog) {
  const int P = rv.world();
  DSV4_CHECK(world >= 1 && world % P == 0, "tcp communicator: ", world, " ranks over ", P,
             " processes (must divide evenly)");
  DSV4_CHECK(timeout_s > 0, "tcp communicator: the timeout must be positive");
  const int per = world / P, lo = rv.rank() * per;
  auto owner = [&](int w) { return w / per; };
  // Everyone listens on a port of its own, then tells the others where.
  const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  DSV4_CHECK(lfd >= 0, "tcp communicator: socket: ", std::strerror(errno));
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(any);
  const int backlog = listen_backlog > 0 ? listen_backlog : std::max(64, world * world);
  if (::bind(lfd, reinterpret_cast<sockaddr*>(&any), sizeof(any)) != 0 ||
      ::listen(lfd, backlog) != 0 ||
      getsockname(lfd, reinterpret_cast<sockaddr*>(&any), &len) != 0) {
    ::close(lfd);
    throw Error(cat("tcp communicator: cannot listen: ", std::strerror(errno)));
  }
  const std::string me = cat(rv.local_address(), " ", ntohs(any.sin_port));
  std::vector<std::vector<uint8_t>> where;
  try {
    where = rv.all_gather(std::vector<uint8_t>(me.begin(), me.end()));
  } catch (...) {
    ::close(lfd);
    throw;
  }

  std::vector<std::shared_ptr<Links>> links;
  for (int l = 0; l < per; ++l) {
    auto L = std::make_shared<Links>();
    L->rank = lo + l;
    L->fds.assign(size_t(world), -1);
    L->timeout_s = timeout_s;
    links.push_back(L);
  }
  // The higher rank of each pair connects to the lower one's process and says who it is. This
  // process accepts on a thread of its own while it connects, so no order of the processes'
  // connects can leave two of them waiting for each other's accept (a listen queue fills up
  // with many ranks; the connect retries until the deadline). The two threads fill disjoint
  // entries of the links: the acceptor fds[b > a] of local a, the connector fds[a < b] of
  // local b.
  const auto start = Clock::now();
  std::atomic<bool> stop_accepting{false};
  std::exception_ptr accept_error;
  int expected = 0;
  for (int a = lo; a < lo + per; ++a) expected += world - 1 - a;
  std::thread acceptor([&] {
    try {
      for (int k = 0; k < expected; ++k) {
        for (;;) {
          DSV4_CHECK(!stop_accepting, "tcp communicator: setup abandoned");
          DSV4_CHECK(seconds_since(start) < timeout_s, "tcp communicator: timed out after ",
                     timeout_s, " s waiting for ", expected - k,
                     " connection(s) from other ranks (a node did not come, or cannot reach "
                     "this one)");
          pollfd p{lfd, POLLIN, 0};
          if (::poll(&p, 1, 100) > 0) break;
        }
        const int fd = ::accept(lfd, nullptr, nullptr);
        DSV4_CHECK(fd >= 0, "tcp communicator: accept: ", std::strerror(errno));
        set_socket_options(fd);
        int32_t hello[2] = {-1, -1};
        timeval tv{5, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        const bool got = ::recv(fd, hello, sizeof(hello), MSG_WAITALL) == ssize_t(sizeof(hello));
        const int a = hello[0], b = hello[1];
        if (!got || a < lo || a >= lo + per || b <= a || b >= world ||
            links[size_t(a - lo)]->fds[size_t(b)] >= 0) {
          ::close(fd);
          throw Error(cat("tcp communicator: a bad connection (pair ", a, ", ", b, ")"));
        }
        tv = {0, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        links[size_t(a - lo)]->fds[size_t(b)] = fd;
      }
    } catch (...) {
      accept_error = std::current_exception();
    }
  });
  std::exception_ptr connect_error;
  try {
    for (int b = lo; b < lo + per; ++b)
      for (int a = 0; a < b; ++a) {
        const std::string w(where[size_t(owner(a))].begin(), where[size_t(owner(a))].end());
        const int fd = connect_by(parse_address(w), start, timeout_s,
                                  cat("rank ", b, " cannot reach rank ", a, " at ", w));
        links[size_t(b - lo)]->fds[size_t(a)] = fd;
        set_socket_options(fd);
        const int32_t hello[2] = {a, b};
        DSV4_CHECK(::send(fd, hello, sizeof(hello), MSG_NOSIGNAL) == ssize_t(sizeof(hello)),
                   "tcp communicator: send: ", std::strerror(errno));
      }
  } catch (...) {
    connect_error = std::current_exception();
    stop_accepting = true;
  }
  acceptor.join();
  ::close(lfd);
  if (connect_error) std::rethrow_exception(connect_error);
  if (accept_error) std::rethrow_exception(accept_error);
  for (auto& L : links)
    for (int fd : L->fds)
      if (fd >= 0) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  rv.barrier();  // every pair connected before anyone sends
  std::vector<int> all(static_cast<size_t>(world));
  for (int w = 0; w < world; ++w) all[size_t(w)] = w;
  std::vector<std::unique_ptr<Communicator>> out;
  for (auto& L : links) out.push_back(std::make_unique<TcpCommunicator>(L, all, 1));
  return out;
}

}  // namespace dsv4
