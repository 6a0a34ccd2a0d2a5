#include "backends/cuda/cache_rollback.h"

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4 {

namespace {

// Upper bounds of the bytes (each piece 16-byte aligned) and segments of a span of
// `positions` positions over blocks [first, last): the window slots, at most one compressed
// entry and indexer key per `ratio` positions (plus one), the states.
struct SpanBound {
  int64_t bytes = 0, segments = 0;
};
SpanBound span_bound(const ModelConfig& m, const DeviceCache& c, int first, int last,
                     int positions) {
  SpanBound s;
  for (int b = first; b < last; ++b) {
    const int r = m.ratio(b);
    s.bytes += int64_t(positions) * c.kv_layout().entry_bytes();
    s.segments += 2 * positions;
    if (r > 0) {
      const int64_t entries = positions / r + 1;
      const CompressorStateLayout l = c.main_state_layout(b);
      // for_each_span_store: a non-overlapping state's rows of the positions, else all of it.
      const bool rows = l.coff() == 1 && positions < l.ratio;
      s.bytes += entries * c.kv_layout().entry_bytes() +
                 (rows ? 2 * int64_t(positions) * l.width() * 4 : l.bytes());
      s.segments += 2 * entries + (rows ? 2 * positions : 1);
    }
    if (r == 4) {
      const int64_t entries = positions / 4 + 1;
      s.bytes += entries * c.index_layout().entry_bytes() + c.index_state_layout().bytes();
      s.segments += 2 * entries + 1;
    }
  }
  s.bytes += 16 * s.segments;
  return s;
}

}  // namespace

CacheRollback::CacheRollback(const ModelConfig& m, const DeviceCache& c, int seqs,
                             int main_positions, int mtp_positions)
    : model_(m) {
  DSV4_CHECK(seqs > 0 && main_positions > 0 && mtp_positions > 0, "cache rollback: bad capacity");
  const SpanBound a = span_bound(m, c, 0, m.n_layers, main_positions);
  const SpanBound b = span_bound(m, c, m.n_layers, m.num_blocks(), mtp_positions);
  area_ = cuda::DeviceBuffer<uint8_t>(size_t(a.bytes + b.bytes + 512) * size_t(seqs));
  // Saves and restores of every span.
  capacity_ = size_t(a.segments + b.segments) * size_t(seqs) * 2;
  DSV4_CUDA_CHECK(cudaMallocHost(&host_, capacity_ * sizeof(glue::CopySegment)));
  device_ = cuda::DeviceBuffer<glue::CopySegment>(capacity_);
}

CacheRollback::~CacheRollback() {
  if (host_) cudaFreeHost(host_);
}

void CacheRollback::reset() {
  used_ = 0;
  flushed_ = count_ = save_first_ = 0;
  saved_.clear();
}

void CacheRollback::add(const uint8_t* src, uint8_t* dst, int64_t bytes) {
  if (count_ > std::max(flushed_, save_first_)) {  // never across two spans
    glue::CopySegment& last = host_[count_ - 1];
    if (last.src + last.bytes == src && last.dst + last.bytes == dst) {
      last.bytes += bytes;
      return;
    }
  }
  DSV4_CHECK(count_ < capacity_, "cache rollback: more copies than planned (", capacity_, ")");
  host_[count_++] = {src, dst, bytes};
}

int CacheRollback::save(DeviceCache& cache, const SequenceCache& s, const CacheSpan& span) {
  uint8_t* base = area_.data() + used_;
  int64_t off = 0;
  const size_t first = save_first_ = count_;
  auto take = [&](const uint8_t* p, int64_t bytes) {
    off = (off + 15) / 16 * 16;
    add(p, base + off, bytes);
    off += bytes;
  };
  for_each_span_store(
      cache, model_, s, span,
      [&](EntryRef r, int64_t data, int64_t scales) {
        take(r.data, data);
        take(r.scales, scales);
      },
      [&](float* st, int64_t floats) {
        take(reinterpret_cast<const uint8_t*>(st), floats * int64_t(sizeof(float)));
      });
  // Checked before anything is copied (flush() launches the copies).
  DSV4_CHECK(used_ + off <= int64_t(area_.size()), "cache rollback: saves of ", used_ + off,
             " bytes in one step, planned ", area_.size());
  used_ += (off + 255) / 256 * 256;
  saved_.push_back({first, count_});
  return int(saved_.size()) - 1;
}

void CacheRollback::launch(size_t from, cudaStream_t stream) {
  if (count_ == from) return;
  DSV4_CUDA_CHECK(cudaMemcpyAsync(device_.data() + from, host_ + from,
                                  (count_ - from) * sizeof(glue::CopySegment),
                                  cudaMemcpyHostToDevice, stream));
  glue::copy_segments(device_.data() + from, int(count_ - from), stream);
}

void CacheRollback::flush(cudaStream_t stream) {
  launch(flushed_, stream);
  flushed_ = count_;
}

void CacheRollback::restore(const std::vector<int>& handles, cudaStream_t stream) {
  DSV4_CHECK(flushed_ == count_, "cache rollback: restore before the saves were flushed");
  const size_t from = count_;
  for (int h : handles) {
    const Saved& sv = saved_.at(size_t(h));
    for (size_t i = sv.first; i < sv.last; ++i) {
      DSV4_CHECK(count_ < capacity_, "cache rollback: more copies than planned");
      const glue::CopySegment g = host_[i];
      host_[count_++] = {g.dst, const_cast<uint8_t*>(g.src), g.bytes};
    }
  }
  launch(from, stream);
  flushed_ = count_;
}

}  // namespace dsv4
