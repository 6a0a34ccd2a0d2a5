#include "model/trace_observer.h"

#include <algorithm>
#include <cstring>

#include "core/formats.h"

namespace dsv4 {

void TraceObserver::after(const OpEvent& e) {
  switch (e.kind) {
    case OpKind::kStepBegin:
      chunk_rows_.clear();
      for (const ChunkRef& c : *e.chunks) chunk_rows_.push_back(c.n);
      break;
    case OpKind::kAttnSublayer:
      floats(e.block, "hidden.in", e.t[2], e.chunk, true);
      floats(e.block, "attn_in", e.t[0], e.chunk);
      floats(e.block, "attn_out", e.t[1], e.chunk);
      break;
    case OpKind::kFfnSublayer:
      floats(e.block, "ffn_in", e.t[0], e.chunk);
      floats(e.block, "ffn_out", e.t[1], e.chunk);
      break;
    case OpKind::kHcPost:
      if (e.id == 1) floats(e.block, "hidden.out", e.t[4], e.chunk, true);
      break;
    case OpKind::kIndexer:
      floats(e.block, "indexer.scores", e.t[6], e.chunk);  // where the backend gives them
      ints(e.block, "indexer.selected", e.t[5], true, e.chunk);
      break;
    case OpKind::kMoe:
      ints(e.block, "route.experts", e.t[2], false, e.chunk);
      floats(e.block, "route.weights", e.t[3], e.chunk);
      break;
    default:
      break;
  }
}

std::vector<std::pair<int, int>> TraceObserver::chunks_of(const TensorRef& t, int chunk) const {
  if (chunk >= 0) return {{chunk, int(t.rows)}};
  std::vector<std::pair<int, int>> out;
  for (size_t c = 0; c < chunk_rows_.size(); ++c) out.push_back({int(c), chunk_rows_[c]});
  return out;
}

void TraceObserver::floats(int block, const char* name, const TensorRef& t, int chunk,
                           bool streams) {
  if (!t.data) return;  // the backend gives no such tensor
  const int64_t w = t.cols, ld = t.stride();
  const size_t es = t.dtype == DType::kBF16 ? 2 : 4;
  // Up to the last row's last element: a strided view's final row may end its buffer.
  std::vector<uint8_t> raw(t.rows > 0 ? (size_t(t.rows - 1) * ld + size_t(w)) * es : 0);
  read_(raw.data(), t.data, raw.size());
  std::vector<float> v(size_t(t.rows) * w);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t i = 0; i < w; ++i) {
      const size_t at = size_t(r) * ld + i;
      if (t.dtype == DType::kBF16) {
        uint16_t b;
        std::memcpy(&b, raw.data() + at * 2, 2);
        v[size_t(r) * w + i] = bf16_to_float(b);
      } else {
        std::memcpy(&v[size_t(r) * w + i], raw.data() + at * 4, 4);
      }
    }
  int64_t row = 0;
  for (const auto& [c, n] : chunks_of(t, chunk)) {
    const std::vector<int64_t> shape =
        streams ? std::vector<int64_t>{n, hc_, dim_} : std::vector<int64_t>{n, w};
    sink_.tensor(block, c, name, v.data() + size_t(row) * w, shape);
    row += n;
  }
}

void TraceObserver::ints(int block, const char* name, const TensorRef& t, bool sort_rows,
                         int chunk) {
  if (!t.data) return;
  const int64_t w = t.cols;
  std::vector<int32_t> v(size_t(t.rows) * w);
  read_(v.data(), t.data, v.size() * 4);
  if (sort_rows)
    for (int64_t r = 0; r < t.rows; ++r)
      std::sort(v.begin() + r * w, v.begin() + (r + 1) * w,
                [](int32_t a, int32_t b) { return (a < 0) != (b < 0) ? b < 0 : a < b; });
  int64_t row = 0;
  for (const auto& [c, n] : chunks_of(t, chunk)) {
    sink_.ints(block, c, name, v.data() + size_t(row) * w, {n, w});
    row += n;
  }
}

}  // namespace dsv4
