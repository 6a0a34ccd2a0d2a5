#include "comm/nccl_communicator.h"

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "comm/collective_aborted.h"
#include "core/error.h"

namespace dsv4 {
namespace {

using Clock = std::chrono::steady_clock;

// NCCL's name for `r`, and its last error message where it left one (it may name the peer, the
// transport or the system call that failed).
std::string nccl_error(ncclResult_t r) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) s += cat(" (NCCL: ", last, ")");
  return s;
}

void check_cuda(cudaError_t e, const char* what) {
  DSV4_CHECK(e == cudaSuccess, "CUDA ", what, ": ", cudaGetErrorString(e));
}

// Before the first NCCL call (NCCL reads its environment once, then keeps it). Once per process:
// the ranks' threads make their communicators at the same time, and setenv races with getenv.
void set_nccl_environment() {
  static std::once_flag once;
  std::call_once(once, [] {
    // NVLink multicast can take a shared host's GPUs out of service: never on.
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
    // It overrides ncclConfig_t::blocking for every communicator: the set-up's deadline and
    // cancel, and the wait for calls that answer ncclInProgress, rely on the modes chosen here.
    unsetenv("NCCL_COMM_BLOCKING");
  });
}

Clock::time_point deadline_after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

struct NcclCommunicator::Impl {
  ncclComm_t comm = nullptr;
  int device = 0;
  int world = 1, rank = 0;
  // The world: ncclConfig_t::blocking = 0 (set-up bounded by `setup`); its splits: blocking.
  bool nonblocking = false;
  NcclSetup setup;
  // abort() may come from another thread than the rank's (the multi-node control plane's
  // watch, when another node failed) while the rank's own failure handler aborts too: the
  // communicator is aborted once, and never destroyed after. On a non-blocking communicator
  // every NCCL call returns at once, so the rank's calls hold `mu` and abort() never frees the
  // communicator under one; a blocking call is never made under `mu` (abort() must be able to
  // end it).
  std::mutex mu;
  std::atomic<bool> aborted{false};

  std::string who() const { return cat("rank ", rank, " of ", world); }

  void abort_locked() {
    if (comm && !aborted.exchange(true)) ncclCommAbort(comm);
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mu);
    abort_locked();
  }
  [[noreturn]] void throw_aborted(const char* what) const {
    throw CollectiveAborted(cat("NCCL ", what, " (", who(),
                                "): the communicator was aborted (collective aborted: another "
                                "rank failed)"));
  }

  // Polls the communicator until NCCL is done with what was last asked of it. With `deadline`
  // (a set-up): `setup.cancelled` and the deadline abort it. An NCCL error aborts it too (NCCL:
  // nothing can be assumed of a communicator after an asynchronous error).
  void wait(const char* what, const Clock::time_point* deadline) {
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (aborted) throw_aborted(what);
        ncclResult_t state = ncclSuccess;
        const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
        if (r != ncclSuccess) state = r;
        if (state == ncclSuccess) return;
        if (state != ncclInProgress) {
          const std::string why = nccl_error(state);
          abort_locked();
          throw Error(cat("NCCL ", what, " (", who(), "): ", why));
        }
      }
      if (deadline) {
        if (setup.cancelled && setup.cancelled()) {
          abort();
          throw CollectiveAborted(
              cat("NCCL ", what, " (", who(), ") cancelled: another rank or node failed"));
        }
        if (Clock::now() >= *deadline) {
          abort();
          throw Error(cat("NCCL ", what, " (", who(), ") did not complete within ", setup.timeout_s,
                          " s: a rank of the world never joined (its process or node failed or "
                          "was not started, or it is stuck)"));
        }
      }
      // A set-up takes seconds; a collective's launch far less.
      if (deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      else
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Makes NCCL calls on this communicator (`enqueue` returns the first failure) and waits until
  // NCCL is done with them (ncclInProgress: a non-blocking communicator's).
  template <typename F>
  void run(const char* what, F&& enqueue, const Clock::time_point* deadline = nullptr) {
    ncclResult_t r;
    if (nonblocking) {
      std::lock_guard<std::mutex> lock(mu);
      if (aborted) throw_aborted(what);
      r = enqueue();
    } else {
      if (aborted) throw_aborted(what);
      r = enqueue();
    }
    // A non-blocking communicator's state is polled whatever the call returned: not every NCCL
    // call passes on the ncclInProgress of the group it ran in (ncclCommSplit returns
    // ncclSuccess while NCCL's thread still works; see split()). The first poll of a finished
    // call answers at once.
    if (nonblocking && (r == ncclSuccess || r == ncclInProgress)) return wait(what, deadline);
    if (r == ncclSuccess) return;
    if (aborted) throw_aborted(what);  // another thread's abort() ended the call
    throw Error(cat("NCCL ", what, " (", who(), "): ", nccl_error(r)));
  }
};

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl, int world, int rank)
    : impl_(std::move(impl)), world_(world), rank_(rank) {}

std::unique_ptr<DeviceCommunicator> NcclCommunicator::split(int color, int key) {
  check_cuda(cudaSetDevice(impl_->device), "set device");
  // NCCL writes the new communicator into child->comm, on its own thread for a non-blocking
  // parent: `child` must outlive that thread (below).
  auto child = std::make_unique<Impl>();
  child->device = impl_->device;
  child->setup = impl_->setup;
  child->nonblocking = false;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  if (!impl_->nonblocking) {
    // A blocking parent: NCCL's split is done (or failed) when the call returns.
    impl_->run("split",
               [&] { return ncclCommSplit(impl_->comm, color, key, &child->comm, &config); });
  } else {
    // A non-blocking parent (NCCL 2.30 init.cc, ncclCommSplit): the split is queued as an async
    // job of the parent and run by the group's own thread; the call returns ncclSuccess (the
    // ncclInProgress of ncclGroupEndInternal is not passed on), with *newcomm still NULL. That
    // thread writes *newcomm when the job ends, and only then sets the parent's state from
    // ncclInProgress to the job's result. So the parent's state is polled whatever the call
    // returned (NCCL's documented pattern: usage/communicators, "nonblocking communicator
    // split"). Every way out of the wait either saw that state leave ncclInProgress or aborted
    // the parent (ncclCommAbort joins NCCL's thread): NCCL never writes into a freed `child`.
    const Clock::time_point deadline = deadline_after(impl_->setup.timeout_s);
    ncclResult_t r;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      if (impl_->aborted) impl_->throw_aborted("split");
      r = ncclCommSplit(impl_->comm, color, key, &child->comm, &config);
      if (r != ncclSuccess && r != ncclInProgress) {
        // Nothing can be assumed of the parent after a failed call: aborted (and any thread of
        // NCCL's joined) before `child` goes.
        const std::string why = nccl_error(r);
        impl_->abort_locked();
        if (child->comm) ncclCommAbort(child->comm);
        throw Error(cat("NCCL split (", impl_->who(), "): ", why));
      }
    }
    try {
      impl_->wait("split", &deadline);
    } catch (...) {
      // The parent was aborted (wait() does, or saw another thread's abort done): NCCL's thread
      // is joined, and a communicator it made is ours to abort (NCCL: abort the parent, then
      // any new communicator returned).
      if (child->comm) ncclCommAbort(child->comm);
      throw;
    }
  }
  DSV4_CHECK(child->comm, "NCCL split (", impl_->who(), "): no communicator made");
  // The child's own state: a blocking communicator is set up, or failed, once made.
  ncclResult_t state = ncclSuccess;
  ncclResult_t e = ncclCommGetAsyncError(child->comm, &state);
  if (e == ncclSuccess) e = state;
  int n = 0, r = 0;
  if (e == ncclSuccess) e = ncclCommCount(child->comm, &n);
  if (e == ncclSuccess) e = ncclCommUserRank(child->comm, &r);
  if (e != ncclSuccess) {
    const std::string why = nccl_error(e);
    ncclCommAbort(child->comm);
    throw Error(cat("NCCL split (", impl_->who(), "): ", why));
  }
  child->world = n;
  child->rank = r;
  return std::unique_ptr<DeviceCommunicator>(new NcclCommunicator(std::move(child), n, r));
}

void NcclCommunicator::abort() {
  if (impl_) impl_->abort();
}

bool NcclCommunicator::nonblocking() const {
  return impl_->nonblocking;
}

std::vector<uint8_t> NcclCommunicator::unique_id() {
  set_nccl_environment();
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  DSV4_CHECK(r == ncclSuccess, "NCCL get unique id: ", nccl_error(r));
  std::vector<uint8_t> b(sizeof(id));
  std::memcpy(b.data(), &id, sizeof(id));
  return b;
}

NcclCommunicator::NcclCommunicator(const std::vector<uint8_t>& id, int world, int rank, int device,
                                   const NcclSetup& setup)
    : impl_(std::make_unique<Impl>()), world_(world), rank_(rank) {
  DSV4_CHECK(id.size() == sizeof(ncclUniqueId), "NCCL unique id of ", id.size(), " bytes");
  DSV4_CHECK(world >= 1 && rank >= 0 && rank < world, "NCCL rank ", rank, " of ", world);
  DSV4_CHECK(setup.timeout_s > 0, "NCCL set-up timeout of ", setup.timeout_s, " s");
  set_nccl_environment();
  impl_->device = device;
  impl_->world = world;
  impl_->rank = rank;
  impl_->setup = setup;
  impl_->nonblocking = true;
  check_cuda(cudaSetDevice(device), "set device");
  ncclUniqueId u;
  std::memcpy(&u, id.data(), sizeof(u));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const Clock::time_point deadline = deadline_after(setup.timeout_s);
  // Returns at once (ncclInProgress) with a communicator that can be polled and aborted; NCCL
  // sets it up on a thread of its own. (No other thread knows this communicator yet.)
  const ncclResult_t r = ncclCommInitRankConfig(&impl_->comm, world, u, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string why = nccl_error(r);
    impl_->abort();  // the communicator, when NCCL made one before failing
    throw Error(cat("NCCL communicator init (", impl_->who(), "): ", why));
  }
  impl_->wait("communicator init", &deadline);
}

NcclCommunicator::~NcclCommunicator() {
  if (impl_ && impl_->comm && !impl_->aborted) {
    cudaSetDevice(impl_->device);
    ncclCommDestroy(impl_->comm);
  }
}

void NcclCommunicator::all_gather(const void* send, void* recv, size_t bytes, cudaStream_t s) {
  impl_->run("all-gather",
             [&] { return ncclAllGather(send, recv, bytes, ncclUint8, impl_->comm, s); });
}

void NcclCommunicator::all_reduce_sum_f32(float* data, size_t count, cudaStream_t s) {
  impl_->run("all-reduce", [&] {
    return ncclAllReduce(data, data, count, ncclFloat32, ncclSum, impl_->comm, s);
  });
}

void NcclCommunicator::all_to_all_v(const void* send, const std::vector<size_t>& send_offset,
                                    const std::vector<size_t>& send_bytes, void* recv,
                                    const std::vector<size_t>& recv_offset,
                                    const std::vector<size_t>& recv_bytes, cudaStream_t s) {
  DSV4_CHECK(int(send_offset.size()) == world_ && int(send_bytes.size()) == world_ &&
                 int(recv_offset.size()) == world_ && int(recv_bytes.size()) == world_,
             "all_to_all_v: one count and offset per rank");
  impl_->run("all-to-all", [&] {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (int p = 0; p < world_ && r == ncclSuccess; ++p) {
      if (send_bytes[size_t(p)])
        r = ncclSend(static_cast<const uint8_t*>(send) + send_offset[size_t(p)],
                     send_bytes[size_t(p)], ncclUint8, p, impl_->comm, s);
      if (r == ncclSuccess && recv_bytes[size_t(p)])
        r = ncclRecv(static_cast<uint8_t*>(recv) + recv_offset[size_t(p)], recv_bytes[size_t(p)],
                     ncclUint8, p, impl_->comm, s);
    }
    // The group is closed whatever happened inside it (it is this thread's state).
    const ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  });
}

}  // namespace dsv4
