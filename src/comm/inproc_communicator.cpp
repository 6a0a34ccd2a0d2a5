#include "comm/inproc_communicator.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <utility>

#include "comm/collective_aborted.h"
#include "core/error.h"

namespace dsv4 {
namespace {

// What the ranks of one communicator share.
struct Hub {
  explicit Hub(int n) : size(n), slots(size_t(n)) {}

  // All ranks wait here; the last to arrive releases the others.
  void barrier() {
    std::unique_lock<std::mutex> lock(mu);
    const uint64_t gen = generation;
    if (aborted)
      throw CollectiveAborted("a rank of the parallel engine failed (collective aborted)");
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen || aborted; });
      if (generation == gen)
        throw CollectiveAborted("a rank of the parallel engine failed (collective aborted)");
    }
  }

  void abort() {
    {
      std::lock_guard<std::mutex> lock(mu);
      aborted = true;
    }
    cv.notify_all();
    std::vector<std::shared_ptr<Hub>> kids;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto& [k, h] : children) kids.push_back(h);
    }
    for (auto& h : kids) h->abort();
  }

  const int size;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  // Per rank: what it offers in the current collective.
  struct Slot {
    const void* data = nullptr;
    size_t bytes = 0;
    const std::vector<std::vector<uint8_t>>* buffers = nullptr;
    int color = 0, key = 0;
  };
  std::vector<Slot> slots;
  // Sub-communicators made by split(): (split number, color) -> hub.
  std::map<std::pair<uint64_t, int>, std::shared_ptr<Hub>> children;
  uint64_t splits = 0;
  bool aborted = false;  // guarded by mu; abort() passes it on to the children
};

class InProcCommunicator final : public Communicator {
 public:
  InProcCommunicator(std::shared_ptr<Hub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return hub_->size; }
  void barrier() override { hub_->barrier(); }
  void abort() override { hub_->abort(); }

  void all_gather(const void* send, size_t bytes, void* recv) override {
    hub_->slots[size_t(rank_)] = {send, bytes, nullptr, 0, 0};
    hub_->barrier();
    for (int r = 0; r < size(); ++r) {
      const Hub::Slot& s = hub_->slots[size_t(r)];
      DSV4_CHECK(s.bytes == bytes, "all_gather: rank ", r, " sends ", s.bytes, " bytes, rank ",
                 rank_, " ", bytes);
      if (bytes) std::memcpy(static_cast<uint8_t*>(recv) + size_t(r) * bytes, s.data, bytes);
    }
    hub_->barrier();  // nobody reuses its send buffer before everyone has read it
  }

  void all_to_all(const std::vector<std::vector<uint8_t>>& send,
                  std::vector<std::vector<uint8_t>>& recv) override {
    DSV4_CHECK(int(send.size()) == size(), "all_to_all: ", send.size(), " buffers for ", size(),
               " ranks");
    hub_->slots[size_t(rank_)] = {nullptr, 0, &send, 0, 0};
    hub_->barrier();
    recv.resize(size_t(size()));
    for (int r = 0; r < size(); ++r)
      recv[size_t(r)] = (*hub_->slots[size_t(r)].buffers)[size_t(rank_)];
    hub_->barrier();
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    hub_->slots[size_t(rank_)] = {nullptr, 0, nullptr, color, key};
    hub_->barrier();
    std::vector<std::pair<int, int>> members;  // (key, rank) of my color
    for (int r = 0; r < size(); ++r)
      if (hub_->slots[size_t(r)].color == color)
        members.emplace_back(hub_->slots[size_t(r)].key, r);
    std::sort(members.begin(), members.end());
    const int my = int(std::find(members.begin(), members.end(), std::make_pair(key, rank_)) -
                       members.begin());
    std::shared_ptr<Hub> child;
    {
      std::lock_guard<std::mutex> lock(hub_->mu);
      auto& c = hub_->children[{hub_->splits, color}];
      if (!c) c = std::make_shared<Hub>(int(members.size()));
      child = c;
    }
    hub_->barrier();
    if (rank_ == 0) {
      std::lock_guard<std::mutex> lock(hub_->mu);
      ++hub_->splits;
    }
    hub_->barrier();
    return std::make_unique<InProcCommunicator>(child, my);
  }

 private:
  std::shared_ptr<Hub> hub_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_inproc_communicators(int n) {
  DSV4_CHECK(n >= 1, "in-process communicator of ", n, " ranks");
  auto hub = std::make_shared<Hub>(n);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) out.push_back(std::make_unique<InProcCommunicator>(hub, r));
  return out;
}

}  // namespace dsv4
