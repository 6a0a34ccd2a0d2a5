// The predecoded key rows of SparseAttnKernel::kWgmmaPredecoded: every key a launch's queries
// can read, decoded once from its 584-byte entry to 512 BF16 (the exact decode the wgmma
// producer runs, decode.cuh), into the workspace rows key_row() (key_source.cuh) names:
//   [0, T)                      the batch's staged entries (batch token order);
//   [T, T + S W)                the window ring of each sequence (row T + s W + slot);
//   [T + S W, + S C)            the compressed entries of each sequence (row ... + s C + entry),
//                               C = a.comp_rows (ceil of (max_position + 1) / ratio).
// A prefill chunk's queries share their keys, so decoding each key once instead of once per
// query takes the decode off the attention kernel's producer (it only copies BF16 rows).
// Rows no query reads as a valid key are left as they are: ring slots of positions below 0 or
// not in the ring (their pages may not exist), compressed entries past what the sequence's last
// token sees, staged rows without staged entries.
#include <cuda_bf16.h>

#include "ops/cuda/common/cuda_check.h"
#include "ops/cuda/common/launch.h"
#include "ops/cuda/common/sm90/sync.cuh"
#include "ops/cuda/sparse_attention/decode.cuh"
#include "ops/cuda/sparse_attention/sparse_attention_config.h"
#include "ops/cuda/sparse_attention/sparse_attention_internal.h"

namespace dsv4::cuda::sparse_attn_detail {
namespace {

using namespace sparse_attn_cfg;
using namespace detail;

constexpr int kThreadsPerRow = 64;  // one 16-byte chunk (8 BF16) of the row each
constexpr int kRowsPerCta = 4;

// Decodes one 16-byte output chunk c (dims 8c .. 8c + 7) of the entry at data / scales.
__device__ __forceinline__ uint4 decode_chunk(const uint8_t* data, const uint8_t* scales, int c) {
  if (c >= kNopeDim / 8)  // RoPE dims: already BF16
    return __ldg(reinterpret_cast<const uint4*>(data + kNopeDim + 16 * (c - kNopeDim / 8)));
  const uint2 w = __ldg(reinterpret_cast<const uint2*>(data + 8 * c));
  const uint32_t s2 = bf16x2_pow2(int(__ldg(scales + c / 8)) - 7);  // block of 64 dims
  uint4 r;
  e4m3x4_to_bf16x4(w.x, s2, r.x, r.y);
  e4m3x4_to_bf16x4(w.y, s2, r.z, r.w);
  return r;
}

__global__ void __launch_bounds__(kThreadsPerRow* kRowsPerCta)
    sparse_attn_predecode_kernel(const AttnArgs a, int64_t rows) {
  sm90::griddep_wait();  // the caches and staged entries are written by the kernels before
  sm90::griddep_launch_dependents();
  const int64_t row = int64_t(blockIdx.x) * kRowsPerCta + threadIdx.x / kThreadsPerRow;
  const int c = threadIdx.x % kThreadsPerRow;
  if (row >= rows) return;
  const int64_t T = a.num_tokens, S = a.num_seqs, W = a.window;
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  if (row < T) {
    if (a.staged_data == nullptr) return;
    data = a.staged_data + row * kEntryData;
    scales = a.staged_scales + row * kEntryScales;
  } else {
    const bool ring = row < T + S * W;
    const int64_t r = ring ? row - T : row - T - S * W;
    const int per = ring ? int(W) : int(a.comp_rows);
    const int s = int(r / per), e = int(r % per);
    const int pos0 = __ldg(a.seq_pos0 + s);
    const int last = pos0 + (__ldg(a.cu_seqlens + s + 1) - __ldg(a.cu_seqlens + s)) - 1;
    const PagedStoreView& v = ring ? a.win : a.comp;
    if (ring) {
      // The ring holds the W positions up to hi (before the batch's tokens when they are
      // staged, else up to the last one); slot e holds the one of them congruent to e.
      const int hi = a.staged_data != nullptr ? pos0 - 1 : last;
      if (hi < 0) return;
      const int j = hi - ((hi - e) % int(W) + int(W)) % int(W);
      if (j < 0) return;
    } else {
      if (e >= (last + 1) / a.ratio) return;
    }
    data = entry_data(v, s, e);
    scales = entry_scales(v, s, e);
  }
  const uint4 out = decode_chunk(data, scales, c);
  *reinterpret_cast<uint4*>(a.keys_bf16 + row * kHeadDim + 8 * c) = out;
}

}  // namespace

void launch_predecode(const AttnArgs& a, cudaStream_t stream) {
  const int64_t rows = predecode_rows(a.num_tokens, a.num_seqs, a.window, a.comp_rows);
  if (rows == 0) return;
  const dim3 grid(unsigned((rows + kRowsPerCta - 1) / kRowsPerCta));
  launch_kernel(LaunchConfig{grid, dim3(kThreadsPerRow * kRowsPerCta), 0, stream, a.pdl},
                sparse_attn_predecode_kernel, a, rows);
}

}  // namespace dsv4::cuda::sparse_attn_detail
