#include "backends/cuda/step.h"

#include "backends/cuda/model.h"

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4 {

StepBuffers::StepBuffers(const StepLimits& l, int window) : limits_(l), window_(window) {
  DSV4_CHECK(l.max_tokens > 0 && l.max_seqs > 0, "step buffers: bad limits");
  int64_t off = 0;
  auto take = [&](int64_t n) {
    const int64_t o = off;
    off += (n + 3) / 4 * 4;  // 16-byte aligned arrays
    return o;
  };
  layout_.tokens = take(l.max_tokens);
  layout_.positions = take(l.max_tokens);
  layout_.token_seq = take(l.max_tokens);
  layout_.insert_seq = take(l.max_tokens);
  layout_.cu_seqlens = take(l.max_seqs + 1);
  layout_.seq_pos0 = take(l.max_seqs);
  layout_.state_slot = take(l.max_seqs);
  layout_.logit_rows = take(l.max_tokens);
  for (int k = 0; k < kNumPageKinds; ++k) {
    DSV4_CHECK(l.stride[k] >= 1, "step buffers: block-table stride < 1");
    layout_.tables[k] = take(int64_t(l.max_seqs) * l.stride[k]);
  }
  layout_.total = off;
  DSV4_CUDA_CHECK(cudaMallocHost(&host_, size_t(off) * sizeof(int32_t)));
  std::fill(host_, host_ + off, 0);
  device_ = cuda::DeviceBuffer<int32_t>(size_t(off));
  device_.fill_bytes(0);
}

StepBuffers::~StepBuffers() {
  if (host_) cudaFreeHost(host_);
}

DeviceStep StepBuffers::build(const std::vector<ChunkRef>& chunks,
                              const std::vector<int>& logit_rows, int64_t max_position,
                              cudaStream_t stream) {
  const int S = static_cast<int>(chunks.size());
  DSV4_CHECK(S >= 1 && S <= limits_.max_seqs, "step of ", S, " sequences (1..", limits_.max_seqs,
             " supported)");
  int T = 0, max_n = 0;
  int64_t max_pos = 0;
  for (const ChunkRef& c : chunks) {
    DSV4_CHECK(c.cache && c.n >= 1 && c.start >= 0, "step: bad chunk");
    T += c.n;
    max_n = std::max(max_n, c.n);
    max_pos = std::max(max_pos, c.start + c.n - 1);
  }
  DSV4_CHECK(T <= limits_.max_tokens, "step of ", T, " tokens exceeds the planned ",
             limits_.max_tokens, " (split the prefill into chunks)");
  DSV4_CHECK(max_pos < (int64_t(1) << 31), "position ", max_pos, " beyond int32");
  DSV4_CHECK(int(logit_rows.size()) <= limits_.max_tokens, "too many logit rows");
  DeviceStep st;
  st.num_seqs = S;
  st.num_tokens = T;
  st.max_seq_tokens = max_n;
  st.max_position = max_position < 0 ? max_pos : max_position;
  DSV4_CHECK(st.max_position >= max_pos, "step: max_position bound ", max_position, " < ", max_pos);
  st.decode_only = max_n == 1;
  st.num_logit_rows = static_cast<int>(logit_rows.size());
  st.chunks = chunks;
  st.logit_row_list = logit_rows;

  int32_t* h = host_;
  int row = 0;
  h[layout_.cu_seqlens] = 0;
  for (int s = 0; s < S; ++s) {
    const ChunkRef& c = chunks[s];
    for (int t = 0; t < c.n; ++t, ++row) {
      h[layout_.tokens + row] = c.tokens[t];
      h[layout_.positions + row] = static_cast<int32_t>(c.start + t);
      h[layout_.token_seq + row] = s;
      // Only the last `window` tokens of a chunk keep their ring slot.
      h[layout_.insert_seq + row] = t >= c.n - window_ ? s : -1;
    }
    h[layout_.cu_seqlens + s + 1] = row;
    h[layout_.seq_pos0 + s] = static_cast<int32_t>(c.start);
    DSV4_CHECK(c.cache->state_slot >= 0, "step: sequence without a state slot");
    h[layout_.state_slot + s] = c.cache->state_slot;
    for (int k = 0; k < kNumPageKinds; ++k) {
      const std::vector<int>& pages = c.cache->pages[k];
      const int stride = limits_.stride[k];
      DSV4_CHECK(int(pages.size()) <= stride, "sequence holds ", pages.size(), " ",
                 page_kind_name(PageKind(k)), " pages, more than the planned ", stride);
      int32_t* t = h + layout_.tables[k] + int64_t(s) * stride;
      std::copy(pages.begin(), pages.end(), t);
      std::fill(t + pages.size(), t + stride, 0);  // padding: never read
    }
  }
  for (size_t i = 0; i < logit_rows.size(); ++i) {
    DSV4_CHECK(logit_rows[i] >= 0 && logit_rows[i] < T, "logit row ", logit_rows[i],
               " out of range");
    h[layout_.logit_rows + i] = logit_rows[i];
  }
  // The scalars' arrays and the used rows of each block table (the tables come last, one
  // after the other, so the first copy also covers table 0's rows).
  auto upload = [&](int64_t from, int64_t to) {
    DSV4_CUDA_CHECK(cudaMemcpyAsync(device_.data() + from, host_ + from,
                                    size_t(to - from) * sizeof(int32_t), cudaMemcpyHostToDevice,
                                    stream));
  };
  upload(0, layout_.tables[0] + int64_t(S) * limits_.stride[0]);
  for (int k = 1; k < kNumPageKinds; ++k)
    upload(layout_.tables[k], layout_.tables[k] + int64_t(S) * limits_.stride[k]);
  const int32_t* d = device_.data();
  st.tokens = d + layout_.tokens;
  st.positions = d + layout_.positions;
  st.token_seq = d + layout_.token_seq;
  st.insert_seq = d + layout_.insert_seq;
  st.cu_seqlens = d + layout_.cu_seqlens;
  st.seq_pos0 = d + layout_.seq_pos0;
  st.state_slot = d + layout_.state_slot;
  st.logit_rows = d + layout_.logit_rows;
  for (int k = 0; k < kNumPageKinds; ++k) {
    st.tables[k] = d + layout_.tables[k];
    st.stride[k] = limits_.stride[k];
  }
  return st;
}

StepLimits step_limits(const ModelConfig& mc, const CudaModelLimits& m, const CacheConfig& c) {
  StepLimits l;
  l.max_tokens = m.max_tokens;
  l.max_seqs = std::min(m.max_seqs, c.max_seqs);
  auto pages = [&](int64_t entries) {
    return int(std::max<int64_t>(1, (entries + c.page_size - 1) / c.page_size));
  };
  l.stride[int(PageKind::kWindow)] = pages(mc.window_size);
  l.stride[int(PageKind::kC4)] = pages(m.max_context / 4);
  l.stride[int(PageKind::kC128)] = pages(m.max_context / 128);
  return l;
}

int64_t decode_bucket(const std::vector<ChunkRef>& chunks, int64_t max_context) {
  int64_t max_pos = 0;
  for (const ChunkRef& c : chunks) max_pos = std::max(max_pos, c.start + c.n - 1);
  int64_t p = 1024;
  while (p < max_pos + 1) p <<= 1;
  return std::min(p, max_context);
}

}  // namespace dsv4
