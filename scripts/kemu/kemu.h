// kemu: CUDA kernels' source compiled as host C++ and run on the CPU, every CUDA thread of a CTA a
// fiber (README.md here). Force-included (-include kemu.h) into every unit kemu.py compiles: the
// CUDA keywords, built-in variables and device intrinsics the kernels use, on the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __forceinline__
#undef __noinline__
#undef __launch_bounds__
#undef __grid_constant__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __cluster_dims__(...)
#define __constant__ static
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __grid_constant__

#define KEMU 1

namespace kemu {

struct ThreadCtx {
  uint3 tid;
  uint3 bid;
  dim3 bdim;
  dim3 gdim;
  int linear = 0;  // linear thread index in the block
};
extern ThreadCtx t;

[[noreturn]] void fail(const char* what);
void syncthreads();
// Each lane of the warp in `mask` deposits `bytes` (<= 64) from `in`; every lane then receives all
// 32 deposits in `all` (64 bytes each). Two-phase: nobody deposits again before all have read.
void warp_gather(unsigned mask, const void* in, int bytes, uint8_t (*all)[64]);
void named_barrier_sync(int id, int count);
void named_barrier_arrive(int id, int count);
uint8_t* dyn_smem();
void* static_smem(const void* key, size_t bytes, size_t align);
template <typename T, size_t A = alignof(T)>
T& shared_var(const void* key) {
  return *static_cast<T*>(static_smem(key, sizeof(T), A > alignof(T) ? A : alignof(T)));
}
uint32_t smem_addr(const void* p);
void* smem_ptr(uint32_t a);
uint32_t map_rank(uint32_t a, uint32_t rank);
void* map_rank_ptr(const void* p, unsigned rank);
void cluster_arrive();
void cluster_wait();
unsigned cluster_rank();
unsigned cluster_size();
void cluster_dims_hint(unsigned x, unsigned y, unsigned z);
void mbar_init(uint64_t* bar, int count);
void mbar_arrive(uint64_t* bar, int64_t tx_bytes);
void mbar_complete_tx(uint64_t* bar, int64_t bytes);
void mbar_wait(uint64_t* bar, uint32_t parity);
void cp_async_mbar_arrive(uint64_t* bar);
void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar);
struct WgmmaOp {
  int kind;  // 0 bf16, 1 e4m3
  int n;
  bool mn_major_b;
  bool a_regs;
  uint64_t da, db;
  uint32_t a[4];
  float* d;
  bool scale_d;
};
void wgmma(const WgmmaOp& op);
void tma_load_2d(const void* map, uint64_t* bar, void* dst, int c0, int c1);
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();
void cp_async_wait(int n);

inline int lane() {
  return t.linear & 31;
}

template <typename T>
T shfl_from(unsigned mask, T v, int src) {
  static_assert(sizeof(T) <= 64);
  uint8_t all[32][64];
  warp_gather(mask, &v, sizeof(T), all);
  T r;
  std::memcpy(&r, all[src], sizeof(T));
  return r;
}
// __shfl_{xor,down,up}_sync: a source lane outside the caller's `width` segment reads its own v.
template <typename T>
T shfl_in_segment(unsigned mask, T v, int src, int width) {
  const int l = lane();
  return shfl_from(mask, v, (src & ~(width - 1)) == (l & ~(width - 1)) ? src : l);
}
// __reduce_*_sync: `op` over the values of the lanes in `mask`, in lane order.
template <typename T, typename Op>
T warp_reduce(unsigned mask, T v, Op op) {
  uint8_t all[32][64];
  warp_gather(mask, &v, sizeof(T), all);
  bool first = true;
  T r{};
  for (int i = 0; i < 32; ++i)
    if ((mask >> i) & 1u) {
      T x;
      std::memcpy(&x, all[i], sizeof(T));
      r = first ? x : op(r, x);
      first = false;
    }
  return r;
}

}  // namespace kemu

extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
constexpr int warpSize = 32;
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

template <class A, class B>
inline auto min(A a, B b) -> std::common_type_t<A, B> {
  using C = std::common_type_t<A, B>;
  return C(b) < C(a) ? C(b) : C(a);
}
template <class A, class B>
inline auto max(A a, B b) -> std::common_type_t<A, B> {
  using C = std::common_type_t<A, B>;
  return C(a) < C(b) ? C(b) : C(a);
}
template <class... A>
cudaError_t cudaFuncSetAttribute(void (*f)(A...), cudaFuncAttribute a, int v) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(f), a, v);
}
template <class... A>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* r, void (*f)(A...)) {
  return ::cudaFuncGetAttributes(r, reinterpret_cast<const void*>(f));
}
template <class... A>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, void (*f)(A...), int bs,
                                                          size_t smem) {
  return ::cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, reinterpret_cast<const void*>(f), bs,
                                                         smem);
}
template <class... A>
cudaError_t cudaOccupancyMaxActiveClusters(int* n, void (*f)(A...), const cudaLaunchConfig_t* c) {
  return ::cudaOccupancyMaxActiveClusters(n, reinterpret_cast<const void*>(f), c);
}

inline void __syncthreads() {
  ::kemu::syncthreads();
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  uint8_t all[32][64];
  char c = 0;
  ::kemu::warp_gather(mask, &c, 1, all);
}
inline void __threadfence() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}
inline void __threadfence_block() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int l = ::kemu::lane();
  return ::kemu::shfl_from(mask, v, (l & ~(width - 1)) | (src & (width - 1)));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
  return ::kemu::shfl_in_segment(mask, v, ::kemu::lane() ^ m, width);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  return ::kemu::shfl_in_segment(mask, v, ::kemu::lane() + int(d), width);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  return ::kemu::shfl_in_segment(mask, v, ::kemu::lane() - int(d), width);
}
inline unsigned __ballot_sync(unsigned mask, int p) {
  uint8_t all[32][64];
  uint8_t b = p ? 1 : 0;
  ::kemu::warp_gather(mask, &b, 1, all);
  unsigned r = 0;
  for (int i = 0; i < 32; ++i)
    if ((mask >> i) & 1u && all[i][0]) r |= 1u << i;
  return r;
}
inline int __any_sync(unsigned mask, int p) {
  return __ballot_sync(mask, p) != 0;
}
inline int __all_sync(unsigned mask, int p) {
  return __ballot_sync(mask, p) == mask;
}
inline unsigned __activemask() {
  return 0xffffffffu;
}
template <typename T>
T __reduce_add_sync(unsigned mask, T v) {
  return ::kemu::warp_reduce(mask, v, [](T x, T y) { return T(x + y); });
}
template <typename T>
T __reduce_max_sync(unsigned mask, T v) {
  return ::kemu::warp_reduce(mask, v, [](T x, T y) { return std::max(x, y); });
}
template <typename T>
T __reduce_min_sync(unsigned mask, T v) {
  return ::kemu::warp_reduce(mask, v, [](T x, T y) { return std::min(x, y); });
}

// ---- bit casts and exact-rounding arithmetic (the host FPU rounds to nearest by default) ----
inline unsigned __float_as_uint(float f) {
  return std::bit_cast<unsigned>(f);
}
inline float __uint_as_float(unsigned u) {
  return std::bit_cast<float>(u);
}
inline int __float_as_int(float f) {
  return std::bit_cast<int>(f);
}
inline float __int_as_float(int u) {
  return std::bit_cast<float>(u);
}
inline long long __double_as_longlong(double d) {
  return std::bit_cast<long long>(d);
}
inline double __longlong_as_double(long long u) {
  return std::bit_cast<double>(u);
}
inline int __double2hiint(double d) {
  return int(std::bit_cast<unsigned long long>(d) >> 32);
}
inline int __double2loint(double d) {
  return int(std::bit_cast<unsigned long long>(d));
}
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fsub_rn(float a, float b) {
  return a - b;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline float __fdiv_rn(float a, float b) {
  return a / b;
}
inline float __fdividef(float a, float b) {
  return a / b;
}
inline float __frcp_rn(float a) {
  return 1.0f / a;
}
inline float __fsqrt_rn(float a) {
  return std::sqrt(a);
}
inline float __fma_rn(float a, float b, float c) {
  return std::fma(a, b, c);
}
inline float __saturatef(float a) {
  return a < 0.f ? 0.f : (a > 1.f ? 1.f : a);
}
inline double __dadd_rn(double a, double b) {
  return a + b;
}
inline double __dsub_rn(double a, double b) {
  return a - b;
}
inline double __dmul_rn(double a, double b) {
  return a * b;
}
inline double __ddiv_rn(double a, double b) {
  return a / b;
}
inline double __fma_rn(double a, double b, double c) {
  return std::fma(a, b, c);
}
inline double __dsqrt_rn(double a) {
  return std::sqrt(a);
}
inline double __drcp_rn(double a) {
  return 1.0 / a;
}
inline float __double2float_rn(double d) {
  return float(d);
}
inline float __int2float_rn(int i) {
  return float(i);
}
inline float __uint2float_rn(unsigned i) {
  return float(i);
}
inline float __ll2float_rn(long long i) {
  return float(i);
}
inline double __int2double_rn(int i) {
  return double(i);
}
inline int __float2int_rn(float f) {
  return int(std::nearbyint(f));
}
inline int __float2int_rz(float f) {
  return int(f);
}
inline int __float2int_rd(float f) {
  return int(std::floor(f));
}
inline int __float2int_ru(float f) {
  return int(std::ceil(f));
}
inline unsigned __float2uint_rn(float f) {
  return unsigned(std::nearbyint(f));
}
inline unsigned __float2uint_rz(float f) {
  return unsigned(f);
}
inline int __double2int_rn(double d) {
  return int(std::nearbyint(d));
}
inline int __double2int_rz(double d) {
  return int(d);
}
inline float __fmaf_rn(float a, float b, float c) {
  return std::fma(a, b, c);
}
inline float __fmul_rz(float a, float b) {
  return a * b;
}
inline float __fadd_rz(float a, float b) {
  return a + b;
}
inline int __mul24(int a, int b) {
  return a * b;
}
inline unsigned __umul24(unsigned a, unsigned b) {
  return a * b;
}
inline int __vimax_s32_relu(int a, int b) {
  return std::max(0, std::max(a, b));
}
inline unsigned __vmaxu2(unsigned a, unsigned b) {
  return (std::max(a & 0xffffu, b & 0xffffu)) | (std::max(a >> 16, b >> 16) << 16);
}
inline float __expf(float x) {
  return std::exp(x);
}
inline float __logf(float x) {
  return std::log(x);
}
inline float __log2f(float x) {
  return std::log2(x);
}
inline float __sinf(float x) {
  return std::sin(x);
}
inline float __cosf(float x) {
  return std::cos(x);
}
inline float __powf(float a, float b) {
  return std::pow(a, b);
}
inline float rsqrtf(float x) {
  return 1.0f / std::sqrt(x);
}
inline double rsqrt(double x) {
  return 1.0 / std::sqrt(x);
}
inline int __popc(unsigned x) {
  return std::popcount(x);
}
inline int __popcll(unsigned long long x) {
  return std::popcount(x);
}
inline int __clz(unsigned x) {
  return std::countl_zero(x);
}
inline int __clzll(unsigned long long x) {
  return std::countl_zero(x);
}
inline int __ffs(unsigned x) {
  return x ? std::countr_zero(x) + 1 : 0;
}
inline int __ffsll(unsigned long long x) {
  return x ? std::countr_zero(x) + 1 : 0;
}
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) {
  return unsigned((uint64_t(a) * uint64_t(b)) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((__uint128_t)a * b) >> 64);
}
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
  const uint64_t v = (uint64_t(b) << 32) | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (s >> (4 * i)) & 0xfu;
    unsigned byte = unsigned(v >> (8 * (sel & 7))) & 0xffu;
    if (sel & 8) byte = (byte & 0x80u) ? 0xffu : 0u;
    r |= byte << (8 * i);
  }
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  const uint64_t v = (uint64_t(hi) << 32) | lo;
  return unsigned((v << (s & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  const uint64_t v = (uint64_t(hi) << 32) | lo;
  return unsigned(v >> (s & 31));
}
inline unsigned __funnelshift_lc(unsigned lo, unsigned hi, unsigned s) {
  return __funnelshift_l(lo, hi, s > 32 ? 32 : s);
}
inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned s) {
  if (s >= 32) return hi;
  return __funnelshift_r(lo, hi, s);
}
template <typename T>
T __ldg(const T* p) {
  return *p;
}
template <typename T>
T __ldcs(const T* p) {
  return *p;
}
template <typename T>
T __ldcg(const T* p) {
  return *p;
}
template <typename T>
T __ldlu(const T* p) {
  return *p;
}
template <typename T>
void __stcs(T* p, T v) {
  *p = v;
}
template <typename T>
void __stcg(T* p, T v) {
  *p = v;
}
inline size_t __cvta_generic_to_shared(const void* p) {
  return ::kemu::smem_addr(p);
}
inline void __trap() {
  ::kemu::fail("__trap");
}
inline void __nanosleep(unsigned) {}
inline long long clock64() {
  return 0;
}
inline unsigned __sm_id() {
  return 0;
}

// ---- atomics on any memory (threads of a block run concurrently) ----
template <typename T>
T atomicAdd(T* p, T v) {
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
  } else {
    T old;
    __atomic_load(p, &old, __ATOMIC_SEQ_CST);
    for (;;) {
      T want = old + v;
      if (__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return old;
    }
  }
}
template <typename T>
T atomicSub(T* p, T v) {
  return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
T atomicOr(T* p, T v) {
  return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
T atomicAnd(T* p, T v) {
  return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
T atomicXor(T* p, T v) {
  return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
T atomicExch(T* p, T v) {
  T r;
  __atomic_exchange(p, &v, &r, __ATOMIC_SEQ_CST);
  return r;
}
template <typename T>
T atomicCAS(T* p, T cmp, T v) {
  __atomic_compare_exchange(p, &cmp, &v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
template <typename T>
T atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v &&
         !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
template <typename T>
T atomicMin(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old > v &&
         !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
template <typename T>
T atomicAdd_block(T* p, T v) {
  return atomicAdd(p, v);
}

namespace kemu {

using Body = std::function<void()>;
// Runs `body` as every thread of every block of the grid (blocks in order).
void run_grid(dim3 grid, dim3 block, size_t smem, dim3 cluster, cudaStream_t stream,
              const Body& body);
// During stream capture, launches are recorded; otherwise run now.
void submit(cudaStream_t stream, std::function<void()> work);

// Every launch (launch_kernel, <<<...>>>, cudaLaunchKernelEx): the arguments converted to the
// kernel's parameter types now, the grid run in stream order (or recorded during capture).
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, dim3 cluster,
            cudaStream_t stream, Args&&... args) {
  auto tup = std::make_shared<std::tuple<std::decay_t<KArgs>...>>(std::forward<Args>(args)...);
  submit(stream,
         [=] { run_grid(grid, block, smem, cluster, stream, [&] { std::apply(kernel, *tup); }); });
}

// kernel<<<grid, block, smem, stream>>>(args), rewritten by kemu.py to launcher(kernel, ...)(args).
template <typename... KArgs>
struct Launcher {
  void (*kernel)(KArgs...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <typename... Args>
  void operator()(Args&&... args) const {
    launch(kernel, grid, block, smem, dim3(1, 1, 1), stream, std::forward<Args>(args)...);
  }
};
template <typename... KArgs>
Launcher<KArgs...> launcher(void (*k)(KArgs...), dim3 g, dim3 b, size_t smem = 0,
                            cudaStream_t st = nullptr) {
  return Launcher<KArgs...>{k, g, b, smem, st};
}

template <typename... KArgs, typename... Args>
cudaError_t launch_ex(const cudaLaunchConfig_t* cfg, void (*kernel)(KArgs...), Args&&... args) {
  dim3 cluster(1, 1, 1);
  for (unsigned i = 0; i < cfg->numAttrs; ++i)
    if (cfg->attrs[i].id == cudaLaunchAttributeClusterDimension)
      cluster = dim3(cfg->attrs[i].val.clusterDim.x, cfg->attrs[i].val.clusterDim.y,
                     cfg->attrs[i].val.clusterDim.z);
  launch(kernel, cfg->gridDim, cfg->blockDim, cfg->dynamicSmemBytes, cluster, cfg->stream,
         std::forward<Args>(args)...);
  return cudaSuccess;
}

}  // namespace kemu
#define cudaLaunchKernelEx ::kemu::launch_ex

// The project's device numerics (BF16 halves and rounding), for the emulations below, rt.cpp and
// the overrides: compiled here as host code like every kernel.
#include "ops/cuda/common/numerics.cuh"

namespace kemu::ptx {
using dsv4::cuda::num::bf16_bits;
using dsv4::cuda::num::bf16_hi;
using dsv4::cuda::num::bf16_lo;
// fma.rn.bf16x2 d, a, {s.h, s.h}, c: one rounding of a * s + c per half.
inline uint32_t fma_bf16x2_bcast(uint32_t a, uint32_t s, int hi, uint32_t c) {
  const float sv = hi ? bf16_hi(s) : bf16_lo(s);
  const float lo = float(double(bf16_lo(a)) * double(sv) + double(bf16_lo(c)));
  const float h = float(double(bf16_hi(a)) * double(sv) + double(bf16_hi(c)));
  return uint32_t(bf16_bits(lo)) | (uint32_t(bf16_bits(h)) << 16);
}
// cvt.rn.relu.bf16x2.f32 d, hi, lo
inline uint32_t cvt_relu_bf16x2(float hi, float lo) {
  auto r = [](float x) -> uint16_t {
    if (std::isnan(x)) return 0x7fff;
    const uint16_t b = bf16_bits(x);
    return (b & 0x8000u) ? 0 : b;
  };
  return uint32_t(r(lo)) | (uint32_t(r(hi)) << 16);
}
// mma.sync.m8n8k4.row.col.f64: A 8x4 (a: row g, col q), B 4x8 (b: row q, col g),
// C 8x8 (c0, c1: row g, cols 2q, 2q+1); g = lane / 4, q = lane % 4.
inline void mma_f64_884(double& c0, double& c1, double a, double b) {
  double mine[2] = {a, b};
  uint8_t all[32][64];
  ::kemu::warp_gather(0xffffffffu, mine, sizeof(mine), all);
  auto A = [&](int r, int k) {
    double v;
    std::memcpy(&v, all[r * 4 + k], 8);
    return v;
  };
  auto B = [&](int k, int n) {
    double v;
    std::memcpy(&v, all[n * 4 + k] + 8, 8);
    return v;
  };
  const int l = ::kemu::lane(), g = l / 4, q = l % 4;
  double* c[2] = {&c0, &c1};
  for (int i = 0; i < 2; ++i) {
    double s = *c[i];
    for (int k = 0; k < 4; ++k) s = std::fma(A(g, k), B(k, 2 * q + i), s);
    *c[i] = s;
  }
}
// mma.sync.m16n8k16.row.col.f64: A 16x16 (a_i: row g + 8 (i % 2), col q + 4 (i / 2)),
// B 16x8 (b_i: row q + 4 i, col g), C 16x8 (c_i: row g + 8 (i / 2), col 2q + i % 2).
inline void mma_f64_16816(double& d0, double& d1, double& d2, double& d3, double a0, double a1,
                          double a2, double a3, double a4, double a5, double a6, double a7,
                          double b0, double b1, double b2, double b3) {
  // 96 bytes a lane: gathered as A (64) then B (32).
  double mine[12] = {a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3};
  uint8_t all[32][64], all2[32][64];
  ::kemu::warp_gather(0xffffffffu, mine, 64, all);
  ::kemu::warp_gather(0xffffffffu, mine + 8, 32, all2);
  auto A = [&](int r, int k) {
    const int g = r % 8, q = k % 4, i = (r / 8) + 2 * (k / 4);
    double v;
    std::memcpy(&v, all[g * 4 + q] + 8 * i, 8);
    return v;
  };
  auto B = [&](int k, int n) {
    const int q = k % 4, i = k / 4;
    double v;
    std::memcpy(&v, all2[n * 4 + q] + 8 * i, 8);
    return v;
  };
  const int l = ::kemu::lane(), g = l / 4, q = l % 4;
  double* d[4] = {&d0, &d1, &d2, &d3};
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i / 2), c = 2 * q + (i % 2);
    double s = *d[i];
    for (int k = 0; k < 16; ++k) s = std::fma(A(r, k), B(k, c), s);
    *d[i] = s;
  }
}
}  // namespace kemu::ptx
