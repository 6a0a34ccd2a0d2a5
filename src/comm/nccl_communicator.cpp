#include "comm/nccl_communicator.h"

#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "comm/collective_aborted.h"
#include "core/error.h"

namespace dsv4 {
namespace {

void check(ncclResult_t r, const char* what) {
  DSV4_CHECK(r == ncclSuccess, "NCCL ", what, ": ", ncclGetErrorString(r));
}

void check_cuda(cudaError_t e, const char* what) {
  DSV4_CHECK(e == cudaSuccess, "CUDA ", what, ": ", cudaGetErrorString(e));
}

// NVLink multicast can take a shared host's GPUs out of service: never on.
void keep_multicast_off() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
}

}  // namespace

struct NcclCommunicator::Impl {
  ncclComm_t comm = nullptr;
  int device = 0;
  // abort() may come from another thread than the rank's (the multi-node control plane's
  // watch, when another node failed) while the rank's own failure handler aborts too: the
  // communicator is aborted once, and never destroyed after.
  std::atomic<bool> aborted{false};
};

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl, int world, int rank)
    : impl_(std::move(impl)), world_(world), rank_(rank) {}

std::unique_ptr<DeviceCommunicator> NcclCommunicator::split(int color, int key) {
  auto child = std::make_unique<Impl>();
  child->device = impl_->device;
  check_cuda(cudaSetDevice(impl_->device), "set device");
  if (impl_->aborted) throw CollectiveAborted("NCCL communicator aborted (collective aborted)");
  check(ncclCommSplit(impl_->comm, color, key, &child->comm, nullptr), "split");
  int n = 0, r = 0;
  check(ncclCommCount(child->comm, &n), "count");
  check(ncclCommUserRank(child->comm, &r), "user rank");
  return std::unique_ptr<DeviceCommunicator>(new NcclCommunicator(std::move(child), n, r));
}

void NcclCommunicator::abort() {
  if (impl_ && impl_->comm && !impl_->aborted.exchange(true)) ncclCommAbort(impl_->comm);
}

std::vector<uint8_t> NcclCommunicator::unique_id() {
  keep_multicast_off();
  ncclUniqueId id;
  check(ncclGetUniqueId(&id), "get unique id");
  std::vector<uint8_t> b(sizeof(id));
  std::memcpy(b.data(), &id, sizeof(id));
  return b;
}

NcclCommunicator::NcclCommunicator(const std::vector<uint8_t>& id, int world, int rank, int device)
    : impl_(std::make_unique<Impl>()), world_(world), rank_(rank) {
  DSV4_CHECK(id.size() == sizeof(ncclUniqueId), "NCCL unique id of ", id.size(), " bytes");
  DSV4_CHECK(world >= 1 && rank >= 0 && rank < world, "NCCL rank ", rank, " of ", world);
  keep_multicast_off();
  impl_->device = device;
  check_cuda(cudaSetDevice(device), "set device");
  ncclUniqueId u;
  std::memcpy(&u, id.data(), sizeof(u));
  check(ncclCommInitRank(&impl_->comm, world, u, rank), "init rank");
}

NcclCommunicator::~NcclCommunicator() {
  if (impl_ && impl_->comm && !impl_->aborted) {
    cudaSetDevice(impl_->device);
    ncclCommDestroy(impl_->comm);
  }
}

void NcclCommunicator::all_gather(const void* send, void* recv, size_t bytes, cudaStream_t s) {
  if (impl_->aborted) throw CollectiveAborted("NCCL communicator aborted (collective aborted)");
  check(ncclAllGather(send, recv, bytes, ncclUint8, impl_->comm, s), "all-gather");
}

void NcclCommunicator::all_reduce_sum_f32(float* data, size_t count, cudaStream_t s) {
  if (impl_->aborted) throw CollectiveAborted("NCCL communicator aborted (collective aborted)");
  check(ncclAllReduce(data, data, count, ncclFloat32, ncclSum, impl_->comm, s), "all-reduce");
}

void NcclCommunicator::all_to_all_v(const void* send, const std::vector<size_t>& send_offset,
                                    const std::vector<size_t>& send_bytes, void* recv,
                                    const std::vector<size_t>& recv_offset,
                                    const std::vector<size_t>& recv_bytes, cudaStream_t s) {
  DSV4_CHECK(int(send_offset.size()) == world_ && int(send_bytes.size()) == world_ &&
                 int(recv_offset.size()) == world_ && int(recv_bytes.size()) == world_,
             "all_to_all_v: one count and offset per rank");
  if (impl_->aborted) throw CollectiveAborted("NCCL communicator aborted (collective aborted)");
  check(ncclGroupStart(), "group start");
  for (int r = 0; r < world_; ++r) {
    if (send_bytes[size_t(r)])
      check(ncclSend(static_cast<const uint8_t*>(send) + send_offset[size_t(r)],
                     send_bytes[size_t(r)], ncclUint8, r, impl_->comm, s),
            "send");
    if (recv_bytes[size_t(r)])
      check(ncclRecv(static_cast<uint8_t*>(recv) + recv_offset[size_t(r)], recv_bytes[size_t(r)],
                     ncclUint8, r, impl_->comm, s),
            "recv");
  }
  check(ncclGroupEnd(), "group end");
}

}  // namespace dsv4
