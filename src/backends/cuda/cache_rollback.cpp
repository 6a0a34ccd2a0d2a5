#include "backends/cuda/cache_rollback.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "ops/cuda/common/cuda_check.h"

namespace dsv4 {

CacheRollback::CacheRollback(const ModelConfig& m, int seqs, int main_positions, int mtp_positions)
    : model_(m) {
  const RollbackBound bound = rollback_bound(m, seqs, main_positions, mtp_positions);
  area_ = cuda::DeviceBuffer<uint8_t>(size_t(bound.bytes));
  capacity_ = size_t(bound.segments);
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

void CacheRollback::pad_saves(size_t segments) {
  DSV4_CHECK(flushed_ == 0 && count_ <= segments && segments <= capacity_,
             "cache rollback: ", count_, " saves padded to ", segments, " (capacity ", capacity_,
             ", ", flushed_, " flushed)");
  while (count_ < segments) host_[count_++] = {nullptr, nullptr, 0};
  save_first_ = count_;  // nothing merges into the padding
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

void CacheRollback::restore_rejected(DeviceCache& cache, const std::vector<Rejected>& spans,
                                     cudaStream_t stream) {
  DSV4_CHECK(flushed_ == count_, "cache rollback: restore before the saves were flushed");
  const size_t from = save_first_ = count_;
  std::vector<SavedRange> ranges;
  for (const Rejected& r : spans) {
    // The span's saved segments (merged ranges: contiguous in the cache and in the save area).
    const Saved& sv = saved_.at(size_t(r.handle));
    ranges.clear();
    for (size_t i = sv.first; i < sv.last; ++i)
      if (host_[i].bytes > 0) ranges.push_back({host_[i].src, host_[i].dst, host_[i].bytes});
    std::sort(ranges.begin(), ranges.end(),
              [](const SavedRange& a, const SavedRange& b) { return a.store < b.store; });
    for_each_rejected_store(cache, model_, *r.seq, r.span, r.kept,
                            [&](uint8_t* p, int64_t n) { add(saved_copy_of(ranges, p, n), p, n); });
  }
  launch(from, stream);
  flushed_ = count_;
}

}  // namespace dsv4
