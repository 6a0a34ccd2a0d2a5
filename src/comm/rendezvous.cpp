#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace dsv4 {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Waits until fd is readable (or writable) or the deadline passes.
void wait_fd(int fd, short events, Clock::time_point start, double timeout,
             const std::string& who) {
  for (;;) {
    // timeout 0: no limit (poll wakes every second all the same).
    const double left = timeout > 0 ? timeout - seconds_since(start) : 1.0;
    DSV4_CHECK(left > 0, "rendezvous: timed out after ", timeout, " s waiting for ", who);
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, int(std::min(left, 1.0) * 1000) + 1);
    if (r > 0) return;
    DSV4_CHECK(r == 0 || errno == EINTR, "rendezvous: poll: ", std::strerror(errno));
  }
}

void send_all(int fd, const void* p, size_t n, double timeout, const std::string& who) {
  const auto start = Clock::now();
  const uint8_t* b = static_cast<const uint8_t*>(p);
  while (n) {
    wait_fd(fd, POLLOUT, start, timeout, who);
    const ssize_t k = ::send(fd, b, n, MSG_NOSIGNAL);
    DSV4_CHECK(k > 0 || errno == EINTR || errno == EAGAIN, "rendezvous: sending to ", who, ": ",
               std::strerror(errno));
    if (k > 0) b += k, n -= size_t(k);
  }
}

void recv_all(int fd, void* p, size_t n, double timeout, const std::string& who) {
  const auto start = Clock::now();
  uint8_t* b = static_cast<uint8_t*>(p);
  while (n) {
    wait_fd(fd, POLLIN, start, timeout, who);
    const ssize_t k = ::recv(fd, b, n, 0);
    DSV4_CHECK(k != 0, "rendezvous: ", who, " closed the connection");
    DSV4_CHECK(k > 0 || errno == EINTR || errno == EAGAIN, "rendezvous: receiving from ", who, ": ",
               std::strerror(errno));
    if (k > 0) b += k, n -= size_t(k);
  }
}

// A blob goes as pieces, each an 8-byte header then its bytes: the header's low 62 bits are
// the piece's length, bit 63 says more pieces follow, bit 62 marks a failure report (the
// bytes are the peer's message; Rendezvous::fail). No piece exceeds kMaxPiece, so a blob of
// any size passes while a corrupt header is still caught.
constexpr uint64_t kMore = uint64_t(1) << 63, kFailure = uint64_t(1) << 62;
constexpr uint64_t kLengthMask = kFailure - 1;
constexpr uint64_t kMaxPiece = uint64_t(1) << 30;

void send_pieces(int fd, const std::vector<uint8_t>& b, uint64_t flags, size_t piece, double t,
                 const std::string& who) {
  size_t at = 0;
  do {
    const size_t n = std::min(piece, b.size() - at);
    const uint64_t h = uint64_t(n) | flags | (at + n < b.size() ? kMore : 0);
    send_all(fd, &h, 8, t, who);
    send_all(fd, b.data() + at, n, t, who);
    at += n;
  } while (at < b.size());
}

std::vector<uint8_t> recv_blob(int fd, double t, const std::string& who) {
  std::vector<uint8_t> b;
  for (;;) {
    uint64_t h = 0;
    recv_all(fd, &h, 8, t, who);
    const uint64_t n = h & kLengthMask;
    DSV4_CHECK(n <= kMaxPiece, "rendezvous: ", who, " sent a piece of ", n, " bytes (at most ",
               kMaxPiece, ")");
    const size_t at = b.size();
    b.resize(at + n);
    recv_all(fd, b.data() + at, n, t, who);
    if (h & kMore) continue;
    if (h & kFailure) throw PeerFailed(std::string(b.begin(), b.end()));
    return b;
  }
}

sockaddr_in address(const std::string& host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) == 1) return a;
  // A host name: its first IPv4 address.
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  DSV4_CHECK(rc == 0 && found, "rendezvous: '", host,
             "' is neither an IPv4 address nor a host name ", "with one (", gai_strerror(rc), ")");
  a.sin_addr = reinterpret_cast<const sockaddr_in*>(found->ai_addr)->sin_addr;
  freeaddrinfo(found);
  return a;
}

}  // namespace

Rendezvous::Rendezvous(const RendezvousOptions& o) : o_(o) {
  DSV4_CHECK(o.world >= 1 && o.rank >= 0 && o.rank < o.world, "rendezvous: rank ", o.rank, " of ",
             o.world);
  DSV4_CHECK(o.master_port > 0 && o.master_port < 65536, "--master-port must be in [1, 65535]");
  DSV4_CHECK(o.max_piece_bytes > 0 && o.max_piece_bytes <= kMaxPiece,
             "rendezvous: pieces of 1 byte to 1 GiB");
  const sockaddr_in addr = address(o.master_addr, o.master_port);
  const auto start = Clock::now();
  if (o.world == 1) return;
  if (o.rank == 0) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    DSV4_CHECK(listen_fd_ >= 0, "rendezvous: socket: ", std::strerror(errno));
    const int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    DSV4_CHECK(::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0,
               "rendezvous: cannot listen on ", o.master_addr, ":", o.master_port, ": ",
               std::strerror(errno));
    DSV4_CHECK(::listen(listen_fd_, o.world) == 0, "rendezvous: listen: ", std::strerror(errno));
    peers_.assign(size_t(o.world), -1);
    for (int k = 1; k < o.world; ++k) {
      wait_fd(listen_fd_, POLLIN, start, o.timeout_s,
              cat(o.world - k, " more ", o.peer_noun, "(s)"));
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      DSV4_CHECK(fd >= 0, "rendezvous: accept: ", std::strerror(errno));
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
      int32_t r = -1;
      recv_all(fd, &r, 4, o.timeout_s, "a connecting rank");
      DSV4_CHECK(r > 0 && r < o.world && peers_[size_t(r)] < 0,
                 "rendezvous: a peer says it is rank ", r, " (world ", o.world,
                 ", or that rank came twice)");
      peers_[size_t(r)] = fd;
    }
  } else {
    int fd = -1;
    for (;;) {  // the master may not be listening yet
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      DSV4_CHECK(fd >= 0, "rendezvous: socket: ", std::strerror(errno));
      if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) break;
      ::close(fd);
      DSV4_CHECK(seconds_since(start) < o.timeout_s, "rendezvous: no master at ", o.master_addr,
                 ":", o.master_port, " within ", o.timeout_s, " s");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    // A master whose host dies without closing is found by keep-alive probes, not never.
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    const int32_t r = o.rank;
    send_all(fd, &r, 4, o.timeout_s, "the master");
    peers_ = {fd};
  }
  barrier();
}

void Rendezvous::send_blob(int peer, const std::vector<uint8_t>& blob, double timeout_s) {
  send_pieces(peers_[size_t(o_.rank == 0 ? peer : 0)], blob, 0, o_.max_piece_bytes, timeout_s,
              name(peer));
}

void Rendezvous::fail(const std::string& why, double linger_s) {
  if (o_.world == 1) return;
  const std::vector<uint8_t> b(why.begin(), why.end());
  for (int r = 0; r < int(peers_.size()); ++r) {
    const int fd = peers_[size_t(r)];
    if (fd < 0) continue;
    try {
      send_pieces(fd, b, kFailure, o_.max_piece_bytes, 5, name(o_.rank == 0 ? r : 0));
    } catch (const Error&) {  // a peer already gone needs no report
    }
  }
  linger(linger_s);
}

void Rendezvous::linger(double linger_s) {
  std::vector<int> fds;
  for (int fd : peers_)
    if (fd >= 0) fds.push_back(fd);
  const auto start = Clock::now();
  while (!fds.empty() && seconds_since(start) < linger_s) {
    std::vector<pollfd> p;
    for (int fd : fds) p.push_back({fd, POLLIN, 0});
    if (::poll(p.data(), p.size(), 100) <= 0) continue;
    std::vector<int> open;
    for (const pollfd& q : p) {
      uint8_t sink[4096];
      const ssize_t k = q.revents ? ::recv(q.fd, sink, sizeof(sink), MSG_DONTWAIT) : 1;
      if (k > 0 || (k < 0 && (errno == EAGAIN || errno == EINTR))) open.push_back(q.fd);
    }
    fds.swap(open);
  }
}

Rendezvous::~Rendezvous() {
  for (int fd : peers_)
    if (fd >= 0) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

std::string Rendezvous::name(int rank) const {
  return rank == 0 && o_.rank != 0 ? cat(o_.peer_noun, " 0 (the master)")
                                   : cat(o_.peer_noun, " ", rank);
}

std::vector<std::vector<uint8_t>> Rendezvous::all_gather(const std::vector<uint8_t>& blob) {
  std::vector<std::vector<uint8_t>> all(size_t(o_.world));
  if (o_.world == 1) {
    all[0] = blob;
    return all;
  }
  const double t = o_.timeout_s;
  if (o_.rank == 0) {
    all[0] = blob;
    for (int r = 1; r < o_.world; ++r) all[size_t(r)] = recv_blob(peers_[size_t(r)], t, name(r));
    for (int r = 1; r < o_.world; ++r)
      for (const auto& b : all) send_blob(r, b, t);
  } else {
    send_blob(0, blob, t);
    for (auto& b : all) b = recv_blob(peers_[0], t, name(0));
  }
  return all;
}

std::vector<uint8_t> Rendezvous::broadcast(const std::vector<uint8_t>& blob, double timeout_s) {
  if (o_.world == 1) return blob;
  const double t = timeout_s < 0 ? o_.timeout_s : timeout_s;
  if (o_.rank == 0) {
    for (int r = 1; r < o_.world; ++r) send_blob(r, blob, t);
    return blob;
  }
  return recv_blob(peers_[0], t, name(0));
}

std::vector<std::vector<uint8_t>> Rendezvous::gather(const std::vector<uint8_t>& blob,
                                                     double timeout_s) {
  const double t = timeout_s < 0 ? o_.timeout_s : timeout_s;
  if (o_.rank != 0) {
    send_blob(0, blob, t);
    return {};
  }
  std::vector<std::vector<uint8_t>> all(size_t(o_.world));
  all[0] = blob;
  for (int r = 1; r < o_.world; ++r) all[size_t(r)] = recv_blob(peers_[size_t(r)], t, name(r));
  return all;
}

void Rendezvous::barrier() {
  all_gather({});
}

std::vector<int> Rendezvous::readable(double wait_s) {
  std::vector<pollfd> p;
  std::vector<int> who;
  for (int r = 0; r < int(peers_.size()); ++r)
    if (peers_[size_t(r)] >= 0) {
      p.push_back({peers_[size_t(r)], POLLIN, 0});
      who.push_back(o_.rank == 0 ? r : 0);
    }
  std::vector<int> out;
  if (p.empty()) return out;
  if (::poll(p.data(), p.size(), int(wait_s * 1000)) <= 0) return out;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i].revents) out.push_back(who[i]);
  return out;
}

bool Rendezvous::closed(int peer) {
  const int fd = peers_.at(size_t(o_.rank == 0 ? peer : 0));
  uint8_t b = 0;
  const ssize_t k = ::recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  return k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

bool Rendezvous::reported(int peer) {
  const int fd = peers_.at(size_t(o_.rank == 0 ? peer : 0));
  uint64_t h = 0;
  const ssize_t k = ::recv(fd, &h, 8, MSG_PEEK | MSG_DONTWAIT);
  if (k == 0) return true;
  if (k < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
  return k == 8 && (h & kFailure);
}

std::vector<uint8_t> Rendezvous::receive(int peer, double timeout_s) {
  DSV4_CHECK(o_.world > 1 && (o_.rank == 0 ? peer > 0 && peer < o_.world : peer == 0),
             "rendezvous: rank ", o_.rank, " cannot receive from rank ", peer);
  return recv_blob(peers_[size_t(o_.rank == 0 ? peer : 0)],
                   timeout_s < 0 ? o_.timeout_s : timeout_s, name(peer));
}

std::string Rendezvous::local_address() const {
  sockaddr_in a = address(o_.master_addr, o_.master_port);  // rank 0: where it listens
  if (o_.rank != 0 && !peers_.empty()) {
    socklen_t n = sizeof(a);
    DSV4_CHECK(getsockname(peers_[0], reinterpret_cast<sockaddr*>(&a), &n) == 0,
               "rendezvous: getsockname: ", std::strerror(errno));
  }
  char text[INET_ADDRSTRLEN] = {};
  DSV4_CHECK(inet_ntop(AF_INET, &a.sin_addr, text, sizeof(text)) != nullptr,
             "rendezvous: inet_ntop: ", std::strerror(errno));
  return text;
}

}  // namespace dsv4
