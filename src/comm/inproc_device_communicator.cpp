#include "comm/inproc_device_communicator.h"

#include <cstdint>

#include "comm/inproc_communicator.h"
#include "core/error.h"

namespace dsv4 {
namespace {

void check(cudaError_t e, const char* what) {
  DSV4_CHECK(e == cudaSuccess, "in-process device collective: ", what, ": ", cudaGetErrorString(e));
}

// What a rank shows the others in one collective (its memory stays valid until the
// collective's closing meeting, which every rank reaches only after its copies are enqueued).
struct Offer {
  const void* send = nullptr;
  size_t bytes = 0;                                  // all_gather
  const std::vector<size_t>* send_offset = nullptr;  // all_to_all_v
  const std::vector<size_t>* send_bytes = nullptr;
  cudaEvent_t ready = nullptr;  // recorded after the sender's producers
};

class InProcDeviceCommunicator final : public DeviceCommunicator {
 public:
  explicit InProcDeviceCommunicator(std::unique_ptr<Communicator> host) : host_(std::move(host)) {}
  ~InProcDeviceCommunicator() override {
    if (ready_) cudaEventDestroy(ready_);
    if (done_) cudaEventDestroy(done_);
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  void abort() override { host_->abort(); }

  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) override {
    Offer mine = open(stream);
    mine.send = send;
    mine.bytes = bytes;
    const std::vector<Offer> all = host_->all_gather(std::vector<Offer>{mine});
    for (int r = 0; r < size(); ++r) {
      const Offer& o = all[size_t(r)];
      DSV4_CHECK(o.bytes == bytes, "all_gather: rank ", r, " sends ", o.bytes, " bytes, rank ",
                 rank(), " ", bytes);
      if (!bytes) continue;
      check(cudaStreamWaitEvent(stream, o.ready, 0), "wait for the sender");
      check(cudaMemcpyAsync(static_cast<uint8_t*>(recv) + size_t(r) * bytes, o.send, bytes,
                            cudaMemcpyDefault, stream),
            "copy");
    }
    close(stream);
  }

  void all_to_all_v(const void* send, const std::vector<size_t>& send_offset,
                    const std::vector<size_t>& send_bytes, void* recv,
                    const std::vector<size_t>& recv_offset, const std::vector<size_t>& recv_bytes,
                    cudaStream_t stream) override {
    const size_t n = size_t(size());
    DSV4_CHECK(send_offset.size() == n && send_bytes.size() == n && recv_offset.size() == n &&
                   recv_bytes.size() == n,
               "all_to_all_v: one count and offset per rank");
    Offer mine = open(stream);
    mine.send = send;
    mine.send_offset = &send_offset;
    mine.send_bytes = &send_bytes;
    const std::vector<Offer> all = host_->all_gather(std::vector<Offer>{mine});
    const size_t me = size_t(rank());
    for (size_t s = 0; s < n; ++s) {
      const Offer& o = all[s];
      const size_t bytes = (*o.send_bytes)[me];
      DSV4_CHECK(bytes == recv_bytes[s], "all_to_all_v: rank ", s, " sends ", bytes,
                 " bytes to rank ", me, ", which expects ", recv_bytes[s]);
      if (!bytes) continue;
      check(cudaStreamWaitEvent(stream, o.ready, 0), "wait for the sender");
      check(cudaMemcpyAsync(static_cast<uint8_t*>(recv) + recv_offset[s],
                            static_cast<const uint8_t*>(o.send) + (*o.send_offset)[me], bytes,
                            cudaMemcpyDefault, stream),
            "copy");
    }
    close(stream);
  }

  std::unique_ptr<DeviceCommunicator> split(int color, int key) override {
    return std::make_unique<InProcDeviceCommunicator>(host_->split(color, key));
  }

 private:
  // Events are made on first use, on the rank's thread (its device current).
  Offer open(cudaStream_t stream) {
    if (!ready_) {
      check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "event");
      check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "event");
    }
    check(cudaEventRecord(ready_, stream), "record");
    Offer o;
    o.ready = ready_;
    return o;
  }
  // No rank's stream goes past the collective before every rank's copies from it are done
  // (its send buffer may be overwritten next). The host meeting also orders the event
  // records: a rank records its events again only after everyone waited on the last ones.
  void close(cudaStream_t stream) {
    check(cudaEventRecord(done_, stream), "record");
    const std::vector<cudaEvent_t> done = host_->all_gather(std::vector<cudaEvent_t>{done_});
    for (int r = 0; r < size(); ++r)
      if (r != rank()) check(cudaStreamWaitEvent(stream, done[size_t(r)], 0), "wait for readers");
  }

  std::unique_ptr<Communicator> host_;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
};

}  // namespace

std::vector<std::unique_ptr<DeviceCommunicator>> make_inproc_device_communicators(int n) {
  std::vector<std::unique_ptr<Communicator>> host = make_inproc_communicators(n);
  std::vector<std::unique_ptr<DeviceCommunicator>> out;
  for (auto& h : host) out.push_back(std::make_unique<InProcDeviceCommunicator>(std::move(h)));
  return out;
}

}  // namespace dsv4
