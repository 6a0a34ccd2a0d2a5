#include "comm/inproc_device_communicator.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>

#include "comm/collective_aborted.h"
#include "comm/inproc_communicator.h"
#include "core/error.h"

namespace dsv4 {
namespace {

constexpr int kMaxRanks = 32;

void check(cudaError_t e, const char* what) {
  DSV4_CHECK(e == cudaSuccess, "in-process device collective: ", what, ": ", cudaGetErrorString(e));
}

// One rank's public state, in mapped pinned host memory (every rank's kernels and the host
// read it; only the rank's own kernels write it, abort() aside).
struct alignas(64) Slot {
  unsigned long long seq;    // collectives this rank's stream has entered
  unsigned long long ready;  // = seq once its send buffer and the fields below are published
  unsigned long long done;   // = seq once its reads of the others' buffers are done
  unsigned long long send;   // its send buffer (device address)
  unsigned long long offset[kMaxRanks];  // where destination d's bytes start in it
  unsigned long long bytes[kMaxRanks];   // and how many
};

// What the first waiting kernel that gave up saw (the world's, in the root table): which
// rank of which communicator waited, for which rank's `ready` (stage 0) or `done` (stage 1) to
// reach which collective, and every rank's counters at that moment.
struct Stall {
  int stalled;  // set last, after the fields below
  int n, rank, waited_for, stage;
  unsigned long long seq;
  unsigned long long seq_of[kMaxRanks], ready_of[kMaxRanks], done_of[kMaxRanks];
};

struct Table {
  int aborted;       // the world's (root table's): set by abort() on any communicator split
                     // from it, or by a kernel that waited past the timeout; the waiting
                     // kernels leave (their data are garbage)
  const int* abort;  // &root table's aborted
  Stall stall;       // the root table's is the world's (see `stalled`)
  Stall* stalled;    // &root table's stall
  unsigned long long timeout_ns;  // a waiting kernel gives up after this long (the world's)
  int size_mismatch;  // a receiver expected other sizes than its sender sent (nothing copied)
  int n;
  Slot slot[1];  // [n]
};

__device__ __forceinline__ unsigned long long load_volatile(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}
// Flags are plain stores of 1 (no atomics on host memory: PCIe need not support them).
__device__ __forceinline__ void set_flag(const int* flag) {
  *reinterpret_cast<volatile int*>(const_cast<int*>(flag)) = 1;
  __threadfence_system();
}
__device__ __forceinline__ bool is_set(const int* flag) {
  return *reinterpret_cast<const volatile int*>(flag) != 0;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins (one thread) until every rank's counter (`ready` for stage 0, `done` for stage 1)
// reaches seq. Leaves early when the world is aborted; after the world's timeout it records
// what it saw in the world's Stall (the first to give up; the host reports it), aborts the
// world so that every other waiting kernel leaves too, and leaves. A collective can only wait
// that long if some rank's kernel never runs: without the timeout the ranks' streams would never
// complete and the process would hang with no word of why.
__device__ void wait_all(Table* t, int me, int stage, unsigned long long seq) {
  const unsigned long long start = global_ns();
  for (int s = 0; s < t->n; ++s) {
    const unsigned long long* c = stage == 0 ? &t->slot[s].ready : &t->slot[s].done;
    for (int spin = 0; load_volatile(c) < seq; ++spin) {
      if (is_set(t->abort)) return;
      if ((spin & 1023) == 1023 && global_ns() - start > t->timeout_ns) {
        Stall* st = t->stalled;
        if (!is_set(&st->stalled)) {
          st->n = t->n;
          st->rank = me;
          st->waited_for = s;
          st->stage = stage;
          st->seq = seq;
          for (int r = 0; r < t->n; ++r) {
            st->seq_of[r] = load_volatile(&t->slot[r].seq);
            st->ready_of[r] = load_volatile(&t->slot[r].ready);
            st->done_of[r] = load_volatile(&t->slot[r].done);
          }
          __threadfence_system();
          set_flag(&st->stalled);
        }
        set_flag(t->abort);
        return;
      }
    }
  }
}

// Publishes this rank's send buffer for the collective it enters, then waits until every rank
// has published the same collective (one thread).
struct Publish {
  Table* t;
  int me;
  unsigned long long send;
  unsigned long long offset[kMaxRanks], bytes[kMaxRanks];
};

__global__ void publish_and_wait_kernel(const Publish p) {
  if (threadIdx.x != 0 || !p.t) return;  // no table: a dry run (InProcDeviceCommunicator::warm_up)
  Table* t = p.t;
  Slot& mine = t->slot[p.me];
  const unsigned long long seq = load_volatile(&mine.seq) + 1;
  *reinterpret_cast<volatile unsigned long long*>(&mine.seq) = seq;
  mine.send = p.send;
  for (int d = 0; d < t->n; ++d) {
    mine.offset[d] = p.offset[d];
    mine.bytes[d] = p.bytes[d];
  }
  // The stream's earlier writes (the send buffer) and the fields above before `ready`.
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long*>(&mine.ready) = seq;
  wait_all(t, p.me, 0, seq);
  __threadfence_system();
}

// recv + recv_offset[s] = recv_bytes[s] bytes of rank s's send buffer at its offset for this
// rank; blockIdx.y = s. Loads bypass L1 (the buffers were written by other streams).
struct Gather {
  const Table* t;
  int me;
  uint8_t* recv;
  unsigned long long recv_offset[kMaxRanks], recv_bytes[kMaxRanks];
};

__global__ void gather_kernel(const Gather g) {
  const int s = blockIdx.y;
  const unsigned long long want = g.recv_bytes[s];
  if (!want || is_set(g.t->abort)) return;
  const Slot& from = g.t->slot[s];
  const unsigned long long sent = load_volatile(&from.bytes[g.me]);
  if (sent != want) {
    if (threadIdx.x == 0 && blockIdx.x == 0) set_flag(&g.t->size_mismatch);
    return;
  }
  const uint8_t* src = reinterpret_cast<const uint8_t*>(load_volatile(&from.send) +
                                                        load_volatile(&from.offset[g.me]));
  uint8_t* dst = g.recv + g.recv_offset[s];
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | want) & 15) == 0) {
    const uint4* a = reinterpret_cast<const uint4*>(src);
    uint4* b = reinterpret_cast<uint4*>(dst);
    for (size_t i = first; i < want / 16; i += stride) b[i] = __ldcg(a + i);
  } else {
    for (size_t i = first; i < want; i += stride) dst[i] = __ldcg(src + i);
  }
}

// This rank's reads are done; then wait until every rank's are (its send buffer may be
// rewritten next).
__global__ void done_and_wait_kernel(Table* t, int me) {
  if (threadIdx.x != 0 || !t) return;  // no table: a dry run
  __threadfence_system();
  const unsigned long long seq = load_volatile(&t->slot[me].seq);
  *reinterpret_cast<volatile unsigned long long*>(&t->slot[me].done) = seq;
  wait_all(t, me, 1, seq);
}

// The table of one communicator's ranks, freed with the last of them; a split's keeps the
// world's (its abort flag) alive.
struct Shared {
  Shared(int n, std::shared_ptr<Shared> parent_, double timeout_s = 0)
      : parent(std::move(parent_)) {
    DSV4_CHECK(n >= 1 && n <= kMaxRanks, "in-process device communicator of ", n, " ranks (1..",
               kMaxRanks, ")");
    const size_t bytes = sizeof(Table) + sizeof(Slot) * size_t(n - 1);
    void* p = nullptr;
    check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "table");
    std::memset(p, 0, bytes);
    table = static_cast<Table*>(p);
    table->n = n;
    table->abort = parent ? parent->table->abort : &table->aborted;
    table->stalled = parent ? parent->table->stalled : &table->stall;
    table->timeout_ns =
        parent ? parent->table->timeout_ns : static_cast<unsigned long long>(timeout_s * 1e9);
  }
  ~Shared() { cudaFreeHost(table); }
  // Releases every waiting kernel of the world's communicators.
  void abort() { *reinterpret_cast<volatile int*>(const_cast<int*>(table->abort)) = 1; }
  bool aborted() const { return *reinterpret_cast<const volatile int*>(table->abort) != 0; }
  // The world's stall, described; empty if no waiting kernel gave up.
  std::string stall() const {
    const volatile Stall* st = table->stalled;
    if (!st->stalled) return {};
    std::ostringstream o;
    o << "a waiting kernel gave up after " << double(table->timeout_ns) * 1e-9 << " s: rank "
      << st->rank << " of a communicator of " << st->n << " waited for rank " << st->waited_for
      << "'s " << (st->stage == 0 ? "publication" : "reads") << " of collective " << st->seq
      << "; each rank's (entered, published, reads done):";
    for (int r = 0; r < st->n && r < kMaxRanks; ++r)
      o << " " << r << ":(" << st->seq_of[r] << "," << st->ready_of[r] << "," << st->done_of[r]
        << ")";
    o << " (a rank's kernel never ran beside the others': the ranks share one GPU)";
    return o.str();
  }
  std::shared_ptr<Shared> parent;
  Table* table = nullptr;
  std::atomic<int> device{-1};  // the GPU every rank's stream is on (the first one seen)
};

class InProcDeviceCommunicator final : public DeviceCommunicator {
 public:
  InProcDeviceCommunicator(std::unique_ptr<Communicator> host, std::shared_ptr<Shared> shared)
      : host_(std::move(host)), shared_(std::move(shared)) {}

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  void abort() override {
    shared_->abort();
    host_->abort();
  }

  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) override {
    const size_t n = size_t(size());
    const std::vector<size_t> off(n, 0), cnt(n, bytes);
    std::vector<size_t> roff(n, 0);
    for (size_t r = 0; r < n; ++r) roff[r] = r * bytes;
    run(send, off, cnt, recv, roff, cnt, stream);
  }

  void all_to_all_v(const void* send, const std::vector<size_t>& send_offset,
                    const std::vector<size_t>& send_bytes, void* recv,
                    const std::vector<size_t>& recv_offset, const std::vector<size_t>& recv_bytes,
                    cudaStream_t stream) override {
    const size_t n = size_t(size());
    DSV4_CHECK(send_offset.size() == n && send_bytes.size() == n && recv_offset.size() == n &&
                   recv_bytes.size() == n,
               "all_to_all_v: one count and offset per rank");
    run(send, send_offset, send_bytes, recv, recv_offset, recv_bytes, stream);
  }

  // Meets, drains the device, meets again (see drain_and_meet): safe before a graph launch (every
  // earlier collective is launched) and after it (every rank's graph is launched).
  void launch_barrier() override {
    host_->barrier();
    drain_and_meet();
  }

  void check_completed() override {
    const std::string stall = shared_->stall();
    DSV4_CHECK(stall.empty(), "in-process device collective (rank ", rank(), " of ", size(),
               "): ", stall);
    DSV4_CHECK(!*reinterpret_cast<volatile int*>(&shared_->table->size_mismatch),
               "in-process device collective (rank ", rank(), " of ", size(),
               "): a rank expected other sizes than were sent to it, nothing was copied (found "
               "once the stream completed: a collective replayed from a CUDA graph runs without "
               "the host)");
  }

  std::unique_ptr<DeviceCommunicator> split(int color, int key) override {
    std::unique_ptr<Communicator> sub = host_->split(color, key);
    // The new group's first rank makes its table and shows the others a pointer to its handle
    // until all have copied it.
    std::shared_ptr<Shared> table;
    auto* handle = new std::shared_ptr<Shared>();
    if (sub->rank() == 0) *handle = std::make_shared<Shared>(sub->size(), shared_);
    const std::vector<std::shared_ptr<Shared>*> all =
        sub->all_gather(std::vector<std::shared_ptr<Shared>*>{handle});
    table = *all[0];
    sub->barrier();
    delete handle;
    return std::make_unique<InProcDeviceCommunicator>(std::move(sub), std::move(table));
  }

 private:
  // Every rank waits until the device has finished all its work, then the ranks meet; only then
  // may anyone launch a kernel that waits for another rank's. Measured on one H200 (stop 32): a
  // rank's first collective kernel, launched right after its buffers were allocated and filled
  // (cudaMalloc, a pageable cudaMemcpy that returns before its copy ends), sometimes never ran
  // while the other ranks' kernels waited for it (2 to 5 times in 8 runs of the collectives test);
  // CUDA orders such allocations and copies against work issued around them, and the waiting
  // kernels never finish. Draining first leaves nothing pending; deadlock-free, since every
  // earlier collective's kernels are launched by every rank before anyone gets here. With it
  // the collectives test passed 10 of 10 runs on the H200 (stop 33).
  void drain_and_meet() {
    check(cudaDeviceSynchronize(), "drain the device before a collective");
    host_->barrier();
  }

  // The three kernels launched once on the stream with nothing to do (no table, no bytes), then
  // drained: whatever a kernel's or a stream's first launch sets up happens while no kernel
  // waits for another rank.
  void warm_up(cudaStream_t stream) {
    publish_and_wait_kernel<<<1, 32, 0, stream>>>(Publish{});
    check(cudaGetLastError(), "publish (dry run)");
    gather_kernel<<<dim3(1, unsigned(size())), 256, 0, stream>>>(Gather{});
    check(cudaGetLastError(), "copy (dry run)");
    done_and_wait_kernel<<<1, 32, 0, stream>>>(nullptr, rank());
    check(cudaGetLastError(), "done (dry run)");
  }

  // One collective: publish (and wait for everyone's), copy in, mark done (and wait for
  // everyone's), three launches on the stream, nothing on the host: capturable.
  void run(const void* send, const std::vector<size_t>& send_offset,
           const std::vector<size_t>& send_bytes, void* recv,
           const std::vector<size_t>& recv_offset, const std::vector<size_t>& recv_bytes,
           cudaStream_t stream) {
    Table* t = shared_->table;
    const int n = size(), me = rank();
    // A consequence of another rank's failure, typed as such (comm/first_failure.h reports the
    // cause, not this echo).
    const std::string stall = shared_->stall();
    DSV4_CHECK(stall.empty(),
               "in-process device collective: an earlier collective failed: ", stall);
    if (shared_->aborted())
      throw CollectiveAborted("in-process device collective aborted (a rank failed)");
    DSV4_CHECK(!*reinterpret_cast<volatile int*>(&t->size_mismatch),
               "in-process device collective: an earlier collective failed (a rank expected "
               "other sizes than were sent to it)");
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream, &capture), "capture status");
    const bool eager = capture == cudaStreamCaptureStatusNone;
    int dev = -1;
    check(cudaGetDevice(&dev), "device");
    int expected = -1;
    if (!shared_->device.compare_exchange_strong(expected, dev))
      DSV4_CHECK(expected == dev, "in-process device collectives: rank ", me, " is on GPU ", dev,
                 ", another on GPU ", expected, " (every rank on one GPU)");
    // Eager: every rank's host work is done (its first use of the kernels and of this stream
    // included), its device work drained, and then the ranks meet; between that meeting and the
    // one after the launches a rank makes no CUDA call but the launches, so no rank's host work
    // (a lazily loaded kernel, an allocation may synchronise the whole context) runs while a
    // rank's waiting kernels depend on launches not yet made. Captured: nothing on the host (a
    // graph launch is bracketed by launch_barrier() instead).
    if (eager && !warmed_up_) {
      warm_up(stream);
      warmed_up_ = true;
    }
    if (eager) drain_and_meet();
    Publish p{};
    p.t = t;
    p.me = me;
    p.send = reinterpret_cast<unsigned long long>(send);
    Gather g{};
    g.t = t;
    g.me = me;
    g.recv = static_cast<uint8_t*>(recv);
    size_t most = 0;
    for (int r = 0; r < n; ++r) {
      p.offset[r] = send_offset[size_t(r)];
      p.bytes[r] = send_bytes[size_t(r)];
      g.recv_offset[r] = recv_offset[size_t(r)];
      g.recv_bytes[r] = recv_bytes[size_t(r)];
      most = std::max(most, recv_bytes[size_t(r)]);
    }
    publish_and_wait_kernel<<<1, 32, 0, stream>>>(p);
    check(cudaGetLastError(), "publish");
    if (most) {
      const size_t blocks = std::min<size_t>(64, std::max<size_t>(1, most / (16 * 256)));
      gather_kernel<<<dim3(unsigned(blocks), unsigned(n)), 256, 0, stream>>>(g);
      check(cudaGetLastError(), "copy");
    }
    done_and_wait_kernel<<<1, 32, 0, stream>>>(t, me);
    check(cudaGetLastError(), "done");
    if (eager) host_->barrier();
  }

  std::unique_ptr<Communicator> host_;
  std::shared_ptr<Shared> shared_;
  bool warmed_up_ = false;
};

}  // namespace

std::vector<std::unique_ptr<DeviceCommunicator>> make_inproc_device_communicators(
    int n, double timeout_s) {
  DSV4_CHECK(timeout_s > 0 && timeout_s < 1e9, "in-process device communicator: timeout ",
             timeout_s, " s (> 0)");
  std::vector<std::unique_ptr<Communicator>> host = make_inproc_communicators(n);
  auto shared = std::make_shared<Shared>(n, nullptr, timeout_s);
  std::vector<std::unique_ptr<DeviceCommunicator>> out;
  for (auto& h : host)
    out.push_back(std::make_unique<InProcDeviceCommunicator>(std::move(h), shared));
  return out;
}

}  // namespace dsv4
