// kemu runtime: the block executor and the CUDA runtime API on host memory.
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <cuda.h>

// KEMU_TSAN (kemu.py --tsan): the kernels are built with ThreadSanitizer and every CUDA thread is a
// TSan fiber switched without synchronisation, so the only happens-before edges between threads
// are the ones annotated below at barriers, warp collectives, mbarriers and the cluster barrier:
// TSan then reports what compute-sanitizer's racecheck would (this file itself is not
// instrumented; its own bookkeeping copies are hidden from TSan).
#ifdef KEMU_TSAN
#include <sanitizer/tsan_interface.h>
extern "C" void AnnotateIgnoreReadsBegin(const char* f, int l);
extern "C" void AnnotateIgnoreReadsEnd(const char* f, int l);
extern "C" void AnnotateIgnoreWritesBegin(const char* f, int l);
extern "C" void AnnotateIgnoreWritesEnd(const char* f, int l);
#define KEMU_RELEASE(a) __tsan_release((void*)(a))
#define KEMU_ACQUIRE(a) __tsan_acquire((void*)(a))
#define KEMU_SWITCH_TSAN(fiber) __tsan_switch_to_fiber((fiber), __tsan_switch_to_fiber_no_sync)
#define KEMU_HIDE_BEGIN()                          \
  do {                                             \
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);  \
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__); \
  } while (0)
#define KEMU_HIDE_END()                          \
  do {                                           \
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__); \
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);  \
  } while (0)
#else
#define KEMU_RELEASE(a) (void)(a)
#define KEMU_ACQUIRE(a) (void)(a)
#define KEMU_SWITCH_TSAN(fiber) (void)(fiber)
#define KEMU_HIDE_BEGIN() (void)0
#define KEMU_HIDE_END() (void)0
#endif
#include <sys/mman.h>

#include "kemu.h"

struct CUstream_st {
  bool capturing = false;
  std::vector<std::function<void()>>* capture = nullptr;
};
struct CUevent_st {};
struct CUgraph_st {
  std::vector<std::function<void()>> work;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> work;
};

namespace kemu {

ThreadCtx t{{}, {}, {}, {}, -1};  // linear -1: outside every kernel
}  // namespace kemu
uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
namespace kemu {

[[noreturn]] void fail(const char* what) {
  if (t.linear >= 0)
    std::fprintf(stderr, "kemu: %s (block %u,%u,%u thread %d)\n", what, t.bid.x, t.bid.y, t.bid.z,
                 t.linear);
  else
    std::fprintf(stderr, "kemu: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

}  // namespace kemu

// Cooperative fibers: every CUDA thread of a block is a fiber on the launching OS thread; a fiber
// runs until it reaches a barrier or a warp collective (or exits), then the next one runs.
asm(R"(
.text
.globl kemu_switch
.type kemu_switch,@function
kemu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size kemu_switch,.-kemu_switch
)");
extern "C" void kemu_switch(void** from_sp, void* to_sp);

namespace kemu {
namespace {

constexpr size_t kArena = 512 * 1024;  // a CTA's shared memory: dynamic at 0, then the statics
constexpr size_t kMaxCtas = 16;        // CTAs of a cluster running together
constexpr size_t kDynMax = 232448;
alignas(4096) uint8_t g_static_arenas[kMaxCtas * kArena];
// The cluster's arenas. Under KEMU_TSAN a fresh allocation for every cluster: TSan forgets the
// last CTA's accesses to freed memory, so a CTA's shared memory has no history from the one
// before it (reused memory would read as races between CTAs).
uint8_t* g_arena_base = g_static_arenas;
uint8_t* arena(int c) {
  return g_arena_base + size_t(c) * kArena;
}
constexpr size_t kStackBytes = 512 * 1024;

struct Bar {
  int arrived = 0;
  uint64_t gen = 0;
};

struct Copy {
  void* dst;
  const void* src;
  int bytes, src_bytes;
};

enum class St { kReady, kWaiting, kDone };

struct Fiber {
  void* sp = nullptr;
  uint8_t* stack = nullptr;
  ThreadCtx ctx;
  int cta = 0;  // rank in the cluster
  St state = St::kReady;
  const uint64_t* wait_word = nullptr;  // runnable again once *wait_word != wait_val
  uint64_t wait_val = 0;
  uint64_t cluster_gen = 0;  // the cluster barrier phase this thread arrived at
  std::vector<std::vector<Copy>> groups;
  std::vector<Copy> open;
  void* tsan = nullptr;  // KEMU_TSAN: the fiber's TSan context, kept across blocks
};

struct MBar {
  int count = 0, pending = 0;
  int64_t tx = 0;
  uint64_t phase = 0;  // completed phases
};

struct Block {
  int live = 0;
  Bar sync;
  Bar named[16];
  Bar warp[32];
  Bar wg[8];
  unsigned warp_live[32] = {};
  uint8_t slots[32][32][64];
  WgmmaOp wg_ops[8][128];
};

Block g_blocks[kMaxCtas];
int g_ctas = 1;
Bar g_cluster_bar;
int g_cluster_live = 0;
std::map<const void*, size_t> g_static_off;  // declaration -> offset, fixed for a launch
size_t g_static_end = 0;
std::map<uint64_t*, MBar> g_mbars;
std::vector<Fiber> g_fibers;
uint8_t* g_stacks = nullptr;
size_t g_stack_count = 0;
Fiber* g_cur = nullptr;
void* g_sched_sp = nullptr;
const Body* g_body = nullptr;
void* g_host_tsan = nullptr;     // KEMU_TSAN: the launching thread's context
char g_grid_start, g_grid_done;  // happens-before from the host into the grid and back
std::recursive_mutex g_launch_m;
dim3 g_cluster_dims(1, 1, 1);
bool g_restart = false;
dim3 g_restart_dims;

Block& cur_block() {
  return g_blocks[g_cur->cta];
}

void do_copy(const Copy& c) {
  if (c.src_bytes > 0) std::memcpy(c.dst, c.src, size_t(c.src_bytes));
  if (c.bytes > c.src_bytes)
    std::memset(static_cast<uint8_t*>(c.dst) + c.src_bytes, 0, size_t(c.bytes - c.src_bytes));
}

void to_scheduler(Fiber& f) {
  KEMU_SWITCH_TSAN(g_host_tsan);
  kemu_switch(&f.sp, g_sched_sp);
}

void yield_until_changed(const uint64_t* word, uint64_t val) {
  g_cur->state = St::kWaiting;
  g_cur->wait_word = word;
  g_cur->wait_val = val;
  to_scheduler(*g_cur);
}

void release(Bar& b) {
  b.arrived = 0;
  ++b.gen;
}

// Arrive; release everyone once `need` have arrived.
void arrive_wait(Bar& b, int need, bool wait) {
  KEMU_RELEASE(&b);
  const uint64_t g = b.gen;
  if (++b.arrived >= need) {
    release(b);
  } else if (wait) {
    yield_until_changed(&b.gen, g);
  }
  if (wait) KEMU_ACQUIRE(&b);
}

void release_if_complete(Bar& b, int need) {
  if (b.arrived > 0 && b.arrived >= need) release(b);
}

void cp_async_wait_fiber(Fiber& f, int n) {
  while (int(f.groups.size()) > n) {
    for (const Copy& c : f.groups.front()) do_copy(c);
    f.groups.erase(f.groups.begin());
  }
}
void cp_async_all(Fiber& f) {
  cp_async_wait_fiber(f, 0);
  for (const Copy& c : f.open) do_copy(c);
  f.open.clear();
}

int wg_live(const Block& B, int wg) {
  int n = 0;
  for (int w = 4 * wg; w < 4 * wg + 4; ++w) n += std::popcount(B.warp_live[w]);
  return n;
}

[[noreturn]] void fiber_entry() {
  KEMU_ACQUIRE(&g_grid_start);
  (*g_body)();
  Fiber& f = *g_cur;
  cp_async_all(f);
  KEMU_RELEASE(&g_grid_done);
  Block& B = g_blocks[f.cta];
  // An exited thread counts as arrived at the barriers the others wait at.
  KEMU_RELEASE(&B.sync);
  KEMU_RELEASE(&B.warp[f.ctx.linear / 32]);
  KEMU_RELEASE(&g_cluster_bar);
  --B.live;
  --g_cluster_live;
  const int w = f.ctx.linear / 32;
  B.warp_live[w] &= ~(1u << (f.ctx.linear % 32));
  release_if_complete(B.sync, B.live);
  release_if_complete(B.warp[w], std::popcount(B.warp_live[w]));
  release_if_complete(B.wg[w / 4], wg_live(B, w / 4));
  release_if_complete(g_cluster_bar, g_cluster_live);
  f.state = St::kDone;
  to_scheduler(f);
  std::abort();
}

void init_fiber(Fiber& f) {
  uint64_t* top = reinterpret_cast<uint64_t*>(f.stack + kStackBytes);
  // [mxcsr|fpucw][r15][r14][r13][r12][rbx][rbp][ret] with the return slot 16-byte aligned.
  top -= 1;  // the return slot 16-byte aligned: rsp = 8 mod 16 at entry, as after a call
  *--top = reinterpret_cast<uint64_t>(&fiber_entry);
  for (int i = 0; i < 6; ++i) *--top = 0;
  *--top = uint64_t(0x1F80) | (uint64_t(0x037F) << 32);
  f.sp = top;
  f.state = St::kReady;
  f.groups.clear();
  f.open.clear();
}

MBar& mbar(uint64_t* bar) {
  auto it = g_mbars.find(bar);
  if (it == g_mbars.end()) fail("mbarrier used before mbarrier.init");
  return it->second;
}
void mbar_check(MBar& m) {
  if (m.pending == 0 && m.tx == 0) {
    ++m.phase;
    m.pending = m.count;
  }
}

}  // namespace

// ---- shared memory ----
uint8_t* dyn_smem() {
  return arena(g_cur ? g_cur->cta : 0);
}
void* static_smem(const void* key, size_t bytes, size_t align) {
  auto it = g_static_off.find(key);
  size_t off;
  if (it != g_static_off.end()) {
    off = it->second;
  } else {
    off = (g_static_end + align - 1) / align * align;
    g_static_end = off + bytes;
    if (g_static_end > kArena) fail("static shared memory beyond the emulator's arena");
    KEMU_HIDE_BEGIN();
    for (int c = 0; c < g_ctas; ++c) {
      std::memset(arena(c) + off, 0xff, bytes);
    }
    KEMU_HIDE_END();
    g_static_off.emplace(key, off);
  }
  return arena(g_cur->cta) + off;
}
uint32_t smem_addr(const void* p) {
  const uint8_t* q = static_cast<const uint8_t*>(p);
  const uint8_t* base = g_arena_base;
  if (q < base || q >= base + kMaxCtas * kArena)
    fail("shared-memory address of a non-shared pointer");
  const size_t d = size_t(q - base);
  if (d / kArena != size_t(g_cur->cta)) fail("shared::cta address of another CTA's memory");
  return uint32_t(d % kArena);
}
void* smem_ptr(uint32_t a) {
  const uint32_t rank = a >> 20;  // DSMEM addresses carry rank + 1 above bit 20
  const int cta = rank ? int(rank) - 1 : g_cur->cta;
  if (cta >= g_ctas) fail("DSMEM rank outside the cluster");
  if ((a & 0xFFFFF) >= kArena) fail("shared address beyond the arena");
  return arena(cta) + (a & 0xFFFFF);
}
uint32_t map_rank(uint32_t a, uint32_t rank) {
  return (a & 0xFFFFF) | ((rank + 1) << 20);
}
void* map_rank_ptr(const void* p, unsigned rank) {
  const uint8_t* q = static_cast<const uint8_t*>(p);
  const size_t d = size_t(q - g_arena_base);
  if (rank >= unsigned(g_ctas)) fail("map_shared_rank outside the cluster");
  return arena(int(rank)) + d % kArena;
}

// ---- barriers and collectives ----
void syncthreads() {
  arrive_wait(cur_block().sync, cur_block().live, true);
}

void named_barrier_sync(int id, int count) {
  if (id == 0) return syncthreads();
  arrive_wait(cur_block().named[id], count, true);
}
void named_barrier_arrive(int id, int count) {
  arrive_wait(cur_block().named[id], count, false);
}

void warp_gather(unsigned mask, const void* in, int bytes, uint8_t (*all)[64]) {
  Block& b = cur_block();
  const int w = t.linear / 32, l = t.linear % 32;
  const int need = std::popcount(mask & b.warp_live[w]);
  if (!((mask >> l) & 1u)) fail("warp collective from a lane outside its mask");
  KEMU_HIDE_BEGIN();
  std::memcpy(b.slots[w][l], in, size_t(bytes));
  KEMU_HIDE_END();
  arrive_wait(b.warp[w], need, true);
  KEMU_HIDE_BEGIN();
  std::memcpy(all, b.slots[w], sizeof(b.slots[w]));
  KEMU_HIDE_END();
  arrive_wait(b.warp[w], need, true);
}

void cluster_arrive() {
  KEMU_RELEASE(&g_cluster_bar);
  g_cur->cluster_gen = g_cluster_bar.gen;
  arrive_wait(g_cluster_bar, g_cluster_live, false);
}
void cluster_wait() {
  if (g_cluster_bar.gen == g_cur->cluster_gen)
    yield_until_changed(&g_cluster_bar.gen, g_cur->cluster_gen);
  KEMU_ACQUIRE(&g_cluster_bar);
}
unsigned cluster_rank() {
  return unsigned(g_cur->cta);
}
unsigned cluster_size() {
  return unsigned(g_ctas);
}
void cluster_dims_hint(unsigned x, unsigned y, unsigned z) {
  if (g_cluster_dims.x == x && g_cluster_dims.y == y && g_cluster_dims.z == z) return;
  g_restart = true;
  g_restart_dims = dim3(x, y, z);
  g_cur->state = St::kDone;
  to_scheduler(*g_cur);
  std::abort();
}

// ---- cp.async ----
void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  g_cur->open.push_back(Copy{dst, src, bytes, src_bytes});
}
void cp_async_commit() {
  g_cur->groups.push_back(std::move(g_cur->open));
  g_cur->open.clear();
}
void cp_async_wait(int n) {
  cp_async_wait_fiber(*g_cur, n);
}

// ---- mbarriers and bulk copies ----
void mbar_init(uint64_t* bar, int count) {
  MBar m;
  m.count = m.pending = count;
  g_mbars[bar] = m;
}
void mbar_arrive(uint64_t* bar, int64_t tx_bytes) {
  KEMU_RELEASE(bar);
  MBar& m = mbar(bar);
  m.tx += tx_bytes;
  --m.pending;
  if (m.pending < 0) fail("mbarrier: more arrivals than its count");
  mbar_check(m);
}
void mbar_complete_tx(uint64_t* bar, int64_t bytes) {
  KEMU_RELEASE(bar);
  MBar& m = mbar(bar);
  m.tx -= bytes;
  mbar_check(m);
}
void mbar_wait(uint64_t* bar, uint32_t parity) {
  for (;;) {
    MBar& m = mbar(bar);
    if ((m.phase & 1u) != (parity & 1u)) {
      KEMU_ACQUIRE(bar);
      return;
    }
    yield_until_changed(&m.phase, m.phase);
  }
}
void cp_async_mbar_arrive(uint64_t* bar) {
  cp_async_all(*g_cur);
  mbar_arrive(bar, 0);
}
void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  std::memcpy(dst, src, bytes);
  mbar_complete_tx(bar, bytes);
}

namespace {
// What cuTensorMapEncodeTiled stores in the CUtensorMap (2-D maps only).
struct TensorMap {
  const void* base;
  uint64_t dim0, dim1, stride1;
  uint32_t box0, box1, esize, swizzle;
};
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap));

// The 32/64/128-byte swizzle of TMA and of wgmma descriptors, on shared-memory address bits: the
// 16-byte chunk index (bits 4..) XOR the 128-byte row index (bits 7..) within the pattern.
uint32_t swizzle(uint32_t a, uint32_t bytes) {
  return bytes ? a ^ (((a >> 7) & (bytes / 16 - 1)) << 4) : a;
}
}  // namespace

void tma_load_2d(const void* map, uint64_t* bar, void* dst, int c0, int c1) {
  TensorMap tm;
  std::memcpy(&tm, map, sizeof(tm));
  const uint32_t base = smem_addr(dst);
  const uint32_t row_bytes = tm.box0 * tm.esize;
  for (uint32_t r = 0; r < tm.box1; ++r)
    for (uint32_t e = 0; e < tm.box0; ++e) {
      const uint32_t a = swizzle(base + r * row_bytes + e * tm.esize, tm.swizzle);
      uint8_t* d = static_cast<uint8_t*>(smem_ptr(a));
      const int64_t x = int64_t(c0) + e, y = int64_t(c1) + r;
      if (x < 0 || y < 0 || uint64_t(x) >= tm.dim0 || uint64_t(y) >= tm.dim1)
        std::memset(d, 0, tm.esize);
      else
        std::memcpy(d,
                    static_cast<const uint8_t*>(tm.base) + uint64_t(y) * tm.stride1 +
                        uint64_t(x) * tm.esize,
                    tm.esize);
    }
  mbar_complete_tx(bar, int64_t(row_bytes) * tm.box1);
}

// ---- wgmma: the warpgroup's 128 operands gathered, one thread computes, all wait ----
namespace {
const uint8_t* desc_byte(uint64_t desc, uint32_t addr_off) {
  const uint32_t start = uint32_t(desc & 0x3FFF) << 4;
  return static_cast<const uint8_t*>(smem_ptr(swizzle(start + addr_off, 128)));
}
uint32_t desc_lbo(uint64_t d) {
  return uint32_t((d >> 16) & 0x3FFF) << 4;
}
uint32_t desc_sbo(uint64_t d) {
  return uint32_t((d >> 32) & 0x3FFF) << 4;
}
float elem(const uint8_t* p, int kind) {
  if (kind == 1) {  // e4m3
    __nv_fp8_e4m3 v;
    std::memcpy(&v, p, 1);
    return float(v);
  }
  uint16_t b;
  std::memcpy(&b, p, 2);
  return ptx::bf16_lo(b);
}
}  // namespace

void wgmma(const WgmmaOp& op) {
  if (((op.da >> 62) != 1 && op.a_regs == false) || (op.db >> 62) != 1)
    fail("wgmma: only 128-byte swizzled descriptors are emulated");
  Block& B = cur_block();
  const int wg = t.linear / 128, idx = t.linear % 128;
  KEMU_HIDE_BEGIN();
  B.wg_ops[wg][idx] = op;
  KEMU_HIDE_END();
  const int need = wg_live(B, wg);
  if (need != 128) fail("wgmma with a partial warpgroup");
  arrive_wait(B.wg[wg], need, true);
  if (idx == 0) {
    const WgmmaOp* ops = B.wg_ops[wg];
    const int K = op.kind == 1 ? 32 : 16, eb = op.kind == 1 ? 1 : 2, N = op.n;
    std::vector<float> A(size_t(64) * K), Bm(size_t(N) * K);
    for (int r = 0; r < 64; ++r)
      for (int k = 0; k < K; ++k) {
        float v;
        if (op.a_regs) {
          const int rr = r % 16, lane = (rr % 8) * 4 + (k % 8) / 2;
          const int reg = (rr < 8 ? 0 : 1) + (k < 8 ? 0 : 2);
          const uint32_t w = ops[32 * (r / 16) + lane].a[reg];
          v = (k % 2) ? ptx::bf16_hi(w) : ptx::bf16_lo(w);
        } else {
          v = elem(desc_byte(op.da, uint32_t(r / 8) * desc_sbo(op.da) + uint32_t(r % 8) * 128u +
                                        uint32_t(k * eb)),
                   op.kind);
        }
        A[size_t(r) * K + k] = v;
      }
    for (int c = 0; c < N; ++c)
      for (int k = 0; k < K; ++k) {
        uint32_t off;
        if (op.mn_major_b)
          off = uint32_t(k / 8) * desc_sbo(op.db) + uint32_t(k % 8) * 128u +
                uint32_t(c / 64) * desc_lbo(op.db) + uint32_t(c % 64) * 2u;
        else
          off = uint32_t(c / 8) * desc_sbo(op.db) + uint32_t(c % 8) * 128u + uint32_t(k * eb);
        Bm[size_t(c) * K + k] = elem(desc_byte(op.db, off), op.kind);
      }
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < N; ++c) {
        double s = 0.0;
        for (int k = 0; k < K; ++k)
          s += double(A[size_t(r) * K + k]) * double(Bm[size_t(c) * K + k]);
        const int rr = r % 16, lane = (rr % 8) * 4 + (c % 8) / 2;
        const int i = (rr >= 8 ? 2 : 0) + (c % 2);
        const WgmmaOp& o = ops[32 * (r / 16) + lane];
        float& d = o.d[4 * (c / 8) + i];
        d = o.scale_d ? float(double(d) + s) : float(s);
      }
  }
  arrive_wait(B.wg[wg], need, true);
}

// ---- the launch ----
void run_grid(dim3 grid, dim3 block, size_t smem, dim3 cluster, cudaStream_t st, const Body& body) {
  std::lock_guard<std::recursive_mutex> lk(g_launch_m);
  if (g_cur) fail("a kernel launched from inside a kernel");
  const int cs = int(cluster.x * cluster.y * cluster.z);
  if (cs < 1 || size_t(cs) > kMaxCtas) fail("cluster size");
  if (grid.x % cluster.x || grid.y % cluster.y || grid.z % cluster.z)
    fail("grid not a multiple of the cluster");
  if (smem > kDynMax) fail("dynamic shared memory above 227 KB");
  const int n = int(block.x * block.y * block.z);
  if (n <= 0 || n > 1024) fail("block size");
  const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
  if (blocks == 0) return;
  static const bool trace = std::getenv("KEMU_TRACE") != nullptr;
  if (trace)
    std::fprintf(stderr, "kemu: grid (%u,%u,%u) block (%u,%u,%u) cluster %d smem %zu\n", grid.x,
                 grid.y, grid.z, block.x, block.y, block.z, cs, smem);
  const size_t total = size_t(n) * size_t(cs);
  if (g_stack_count < total) {
    if (g_stacks) munmap(g_stacks, g_stack_count * kStackBytes);
    g_stacks = static_cast<uint8_t*>(mmap(nullptr, total * kStackBytes, PROT_READ | PROT_WRITE,
                                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (g_stacks == MAP_FAILED) fail("fiber stacks");
    for (size_t i = 0; i < total; ++i) mprotect(g_stacks + i * kStackBytes, 4096, PROT_NONE);
    g_stack_count = total;
  }
  g_fibers.resize(total);
  for (size_t i = 0; i < total; ++i) g_fibers[i].stack = g_stacks + i * kStackBytes;
  g_body = &body;
#ifdef KEMU_TSAN
  g_host_tsan = __tsan_get_current_fiber();
  for (size_t i = 0; i < total; ++i)
    if (!g_fibers[i].tsan) g_fibers[i].tsan = __tsan_create_fiber(0);
#endif
  KEMU_RELEASE(&g_grid_start);
  g_ctas = cs;
  g_cluster_dims = cluster;
  g_static_off.clear();
  g_static_end = (smem + 1023) / 1024 * 1024;
  g_restart = false;
  const dim3 cgrid(grid.x / cluster.x, grid.y / cluster.y, grid.z / cluster.z);
  const uint64_t clusters = uint64_t(cgrid.x) * cgrid.y * cgrid.z;
  for (uint64_t cl = 0; cl < clusters; ++cl) {
    const uint3 cid{unsigned(cl % cgrid.x), unsigned((cl / cgrid.x) % cgrid.y),
                    unsigned(cl / (uint64_t(cgrid.x) * cgrid.y))};
#ifdef KEMU_TSAN
    g_arena_base = static_cast<uint8_t*>(std::aligned_alloc(4096, size_t(cs) * kArena));
    KEMU_RELEASE(&g_grid_start);  // the allocation happens before the cluster's accesses
#endif
    g_mbars.clear();
    g_cluster_bar = Bar{};
    g_cluster_live = int(total);
    for (int c = 0; c < cs; ++c) {
      Block& B = g_blocks[c];
      B.live = n;
      B.sync = Bar{};
      for (auto& x : B.named) x = Bar{};
      for (auto& x : B.wg) x = Bar{};
      for (int w = 0; w < 32; ++w) {
        B.warp[w] = Bar{};
        const int lanes = std::clamp(n - 32 * w, 0, 32);
        B.warp_live[w] = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
      }
      KEMU_HIDE_BEGIN();
      std::memset(arena(c), 0xff, g_static_end);  // poison: NaN in every float format
      KEMU_HIDE_END();
      const unsigned rx = unsigned(c) % cluster.x, ry = (unsigned(c) / cluster.x) % cluster.y,
                     rz = unsigned(c) / (cluster.x * cluster.y);
      const uint3 bid{cid.x * cluster.x + rx, cid.y * cluster.y + ry, cid.z * cluster.z + rz};
      for (int i = 0; i < n; ++i) {
        Fiber& f = g_fibers[size_t(c) * n + size_t(i)];
        f.ctx.linear = i;
        f.ctx.tid = uint3{unsigned(i % block.x), unsigned((i / block.x) % block.y),
                          unsigned(i / (block.x * block.y))};
        f.ctx.bid = bid;
        f.ctx.bdim = block;
        f.ctx.gdim = grid;
        f.cta = c;
        init_fiber(f);
      }
    }
    size_t done = 0;
    while (done < total) {
      bool progress = false;
      for (size_t i = 0; i < total; ++i) {
        Fiber& f = g_fibers[i];
        if (f.state == St::kDone) continue;
        if (f.state == St::kWaiting && *f.wait_word == f.wait_val) continue;
        f.state = St::kReady;
        g_cur = &f;
        t = f.ctx;
        threadIdx = f.ctx.tid;
        blockIdx = f.ctx.bid;
        blockDim = f.ctx.bdim;
        gridDim = f.ctx.gdim;
        KEMU_SWITCH_TSAN(f.tsan);
        kemu_switch(&g_sched_sp, f.sp);
        g_cur = nullptr;
        progress = true;
        if (g_restart) break;
        if (f.state == St::kDone) ++done;
      }
      if (g_restart) break;
      if (!progress) {
        for (size_t i = 0; i < total; ++i)
          if (g_fibers[i].state != St::kDone) {
            t = g_fibers[i].ctx;
            break;
          }
        fail("deadlock: every live thread waits at a barrier that cannot complete");
      }
    }
#ifdef KEMU_TSAN
    KEMU_ACQUIRE(&g_grid_done);  // every access of the cluster happens before the free
    std::free(g_arena_base);
    g_arena_base = g_static_arenas;
#endif
    if (g_restart) {
      if (cl != 0) fail("cluster hint after the first cluster");
      g_body = nullptr;
      const dim3 d = g_restart_dims;
      g_restart = false;
      return run_grid(grid, block, smem, d, st, body);
    }
  }
  g_body = nullptr;
  KEMU_ACQUIRE(&g_grid_done);
  t = ThreadCtx{{}, {}, {}, {}, -1};
}

std::mutex g_capture_m;

void submit(cudaStream_t stream, std::function<void()> work) {
  if (stream && stream != cudaStreamLegacy && stream != cudaStreamPerThread) {
    std::lock_guard<std::mutex> lk(g_capture_m);
    if (stream->capturing) {
      stream->capture->push_back(std::move(work));
      return;
    }
  }
  work();
}

}  // namespace kemu

// ---- CUDA runtime API on host memory ----
extern "C" {

cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) {
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  return cudaSuccess;
}
cudaError_t cudaPeekAtLastError() {
  return cudaSuccess;
}
const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "kemu error";
}
const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaSuccess ? "cudaSuccess" : "kemu";
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}

// The device kemu reports: an H200's limits, so heuristics choose what they choose there.
constexpr size_t kTotalMem = size_t(140) << 30;
static int attr_value(cudaDeviceAttr a) {
  switch (a) {
    case cudaDevAttrMultiProcessorCount:
      return 132;
    case cudaDevAttrComputeCapabilityMajor:
      return 9;
    case cudaDevAttrComputeCapabilityMinor:
      return 0;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      return int(kemu::kDynMax);
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      return 233472;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      return 49152;
    case cudaDevAttrL2CacheSize:
      return 50 * 1024 * 1024;
    case cudaDevAttrMaxThreadsPerBlock:
      return 1024;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
      return 2048;
    case cudaDevAttrWarpSize:
      return 32;
    case cudaDevAttrMaxRegistersPerBlock:
      return 65536;
    case cudaDevAttrMaxRegistersPerMultiprocessor:
      return 65536;
    case cudaDevAttrClockRate:
      return 1980000;
    case cudaDevAttrMemoryClockRate:
      return 2619000;
    case cudaDevAttrGlobalMemoryBusWidth:
      return 6144;
    default:
      return 0;
  }
}
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = attr_value(a);
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  std::memset(p, 0, sizeof(*p));
  std::snprintf(p->name, sizeof(p->name), "kemu (CPU emulation of an H200)");
  p->major = attr_value(cudaDevAttrComputeCapabilityMajor);
  p->minor = attr_value(cudaDevAttrComputeCapabilityMinor);
  p->multiProcessorCount = attr_value(cudaDevAttrMultiProcessorCount);
  p->sharedMemPerBlockOptin = size_t(attr_value(cudaDevAttrMaxSharedMemoryPerBlockOptin));
  p->sharedMemPerMultiprocessor = size_t(attr_value(cudaDevAttrMaxSharedMemoryPerMultiprocessor));
  p->sharedMemPerBlock = size_t(attr_value(cudaDevAttrMaxSharedMemoryPerBlock));
  p->totalGlobalMem = kTotalMem;
  p->l2CacheSize = attr_value(cudaDevAttrL2CacheSize);
  p->maxThreadsPerBlock = attr_value(cudaDevAttrMaxThreadsPerBlock);
  p->maxThreadsPerMultiProcessor = attr_value(cudaDevAttrMaxThreadsPerMultiProcessor);
  p->warpSize = attr_value(cudaDevAttrWarpSize);
  p->regsPerBlock = attr_value(cudaDevAttrMaxRegistersPerBlock);
  p->regsPerMultiprocessor = attr_value(cudaDevAttrMaxRegistersPerMultiprocessor);
  p->memoryBusWidth = attr_value(cudaDevAttrGlobalMemoryBusWidth);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_b, size_t* total) {
  *free_b = kTotalMem - (size_t(10) << 30);
  *total = kTotalMem;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t n) {
  *p = std::aligned_alloc(256, (n + 255) / 256 * 256 + 256);
  if (!*p) return cudaErrorMemoryAllocation;
  std::memset(*p, 0xa5, n);
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t) {
  return cudaMalloc(p, n);
}
cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  return cudaFree(p);
}
cudaError_t cudaMallocHost(void** p, size_t n) {
  return cudaMalloc(p, n);
}
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int) {
  return cudaMalloc(p, n);
}
cudaError_t cudaFreeHost(void* p) {
  return cudaFree(p);
}
cudaError_t cudaHostRegister(void*, size_t, unsigned int) {
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void*) {
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) {
  if (n) std::memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t st) {
  kemu::submit(st, [=] {
    if (n) std::memmove(d, s, n);
  });
  return cudaSuccess;
}
cudaError_t cudaMemcpy2D(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h,
                         cudaMemcpyKind) {
  for (size_t r = 0; r < h; ++r)
    std::memmove(static_cast<char*>(d) + r * dp, static_cast<const char*>(s) + r * sp, w);
  return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h,
                              cudaMemcpyKind k, cudaStream_t st) {
  kemu::submit(st, [=] { cudaMemcpy2D(d, dp, s, sp, w, h, k); });
  return cudaSuccess;
}
cudaError_t cudaMemcpyPeer(void* d, int, const void* s, int, size_t n) {
  std::memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyPeerAsync(void* d, int, const void* s, int, size_t n, cudaStream_t st) {
  kemu::submit(st, [=] { std::memmove(d, s, n); });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* d, int v, size_t n) {
  std::memset(d, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t st) {
  kemu::submit(st, [=] { std::memset(d, v, n); });
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = new CUstream_st;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  return cudaStreamCreate(s);
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int, int) {
  return cudaStreamCreate(s);
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t) {
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) {
  return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  std::lock_guard<std::mutex> lk(kemu::g_capture_m);
  s->capturing = true;
  s->capture = new std::vector<std::function<void()>>;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  std::lock_guard<std::mutex> lk(kemu::g_capture_m);
  *g = new CUgraph_st;
  (*g)->work = std::move(*s->capture);
  delete s->capture;
  s->capture = nullptr;
  s->capturing = false;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* st) {
  *st = (s && s != cudaStreamLegacy && s != cudaStreamPerThread && s->capturing)
            ? cudaStreamCaptureStatusActive
            : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* e, cudaGraph_t g, unsigned long long) {
  *e = new CUgraphExec_st;
  (*e)->work = g->work;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
  for (auto& w : e->work) kemu::submit(s, w);
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete g;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  return cudaEventCreate(e);
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) {
  return cudaSuccess;
}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t, cudaStream_t, unsigned int) {
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) {
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t) {
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) {
  *ms = 0.0f;
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) {
  return cudaSuccess;
}
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, const void*) {
  std::memset(a, 0, sizeof(*a));
  a->maxThreadsPerBlock = 1024;
  a->numRegs = 64;
  return cudaSuccess;
}
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* nb, const void*, int bs,
                                                          size_t smem) {
  int by_threads = 2048 / std::max(bs, 1);
  int by_smem = int(233472 / (smem + 1024));
  *nb = std::max(1, std::min({by_threads, by_smem, 32}));
  return cudaSuccess;
}
cudaError_t cudaOccupancyMaxActiveClusters(int* n, const void*, const cudaLaunchConfig_t*) {
  *n = 8;
  return cudaSuccess;
}
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t*, const void*, void**) {
  kemu::fail("cudaLaunchKernelEx called directly: not emulated (use launch_kernel)");
}
cudaError_t cudaLaunchKernel(const void*, dim3, dim3, void**, size_t, cudaStream_t) {
  kemu::fail("cudaLaunchKernel: not emulated");
}
static CUresult kemu_encode_tiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                  void* addr, const cuuint64_t* dims, const cuuint64_t* strides,
                                  const cuuint32_t* box, const cuuint32_t* estr,
                                  CUtensorMapInterleave, CUtensorMapSwizzle swz,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
  if (rank != 2) kemu::fail("tensor maps of rank other than 2 are not emulated");
  if (estr[0] != 1 || estr[1] != 1) kemu::fail("tensor map element strides not emulated");
  int esize = 0;
  switch (type) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8:
      esize = 1;
      break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
      esize = 2;
      break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
      esize = 4;
      break;
    default:
      kemu::fail("tensor map data type not emulated");
  }
  kemu::TensorMap tm{};
  tm.base = addr;
  tm.dim0 = dims[0];
  tm.dim1 = dims[1];
  tm.stride1 = strides[0];
  tm.box0 = box[0];
  tm.box1 = box[1];
  tm.esize = uint32_t(esize);
  tm.swizzle = swz == CU_TENSOR_MAP_SWIZZLE_128B  ? 128u
               : swz == CU_TENSOR_MAP_SWIZZLE_64B ? 64u
               : swz == CU_TENSOR_MAP_SWIZZLE_32B ? 32u
                                                  : 0u;
  std::memset(map, 0, sizeof(*map));
  std::memcpy(map, &tm, sizeof(tm));
  return CUDA_SUCCESS;
}
cudaError_t cudaGetDriverEntryPointByVersion(const char* sym, void** f, unsigned int,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult* r) {
  if (std::strcmp(sym, "cuTensorMapEncodeTiled") == 0) {
    *f = reinterpret_cast<void*>(&kemu_encode_tiled);
    if (r) *r = cudaDriverEntryPointSuccess;
    return cudaSuccess;
  }
  *f = nullptr;
  if (r) *r = cudaDriverEntryPointSymbolNotFound;
  return cudaErrorNotSupported;
}
cudaError_t cudaDeviceCanAccessPeer(int* c, int, int) {
  *c = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int, unsigned int) {
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  std::memset(a, 0, sizeof(*a));
  a->type = cudaMemoryTypeDevice;
  a->devicePointer = const_cast<void*>(p);
  a->hostPointer = const_cast<void*>(p);
  return cudaSuccess;
}
cudaError_t cudaDeviceSetLimit(cudaLimit, size_t) {
  return cudaSuccess;
}
cudaError_t cudaDeviceGetLimit(size_t* v, cudaLimit) {
  *v = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceReset() {
  return cudaSuccess;
}
cudaError_t cudaSetDeviceFlags(unsigned int) {
  return cudaSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode*) {
  return cudaSuccess;
}

}  // extern "C"
