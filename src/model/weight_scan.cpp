#include "model/weight_scan.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/excerpt.h"
#include "core/formats.h"

namespace dsv4 {
namespace {

// A piece of one tensor, so that a few huge tensors (embedding, head) still spread over all
// workers.
struct Piece {
  size_t tensor;
  int64_t begin, end;  // element range
};
constexpr int64_t kPieceBytes = 8ll << 20;

// An element whose exponent field is all ones is NaN or infinite.
template <typename Bits>
bool all_ones(Bits v, Bits exp) {
  return (v & exp) == exp;
}

// Counts the elements in [b, e) whose exponent bits are all ones and finds the first.
template <typename Bits>
int64_t count_bad(const uint8_t* data, int64_t b, int64_t e, Bits exp, int64_t* first) {
  int64_t n = 0;
  for (int64_t i = b; i < e; ++i) {
    Bits v;
    std::memcpy(&v, data + i * int64_t(sizeof(Bits)), sizeof(Bits));
    n += all_ones(v, exp);
  }
  if (n > 0)
    for (int64_t i = b; i < e; ++i) {
      Bits v;
      std::memcpy(&v, data + i * int64_t(sizeof(Bits)), sizeof(Bits));
      if (all_ones(v, exp)) {
        *first = i;
        break;
      }
    }
  return n;
}

int64_t count_piece(const TensorView& t, int64_t b, int64_t e, int64_t* first) {
  switch (t.dtype) {
    case DType::kBF16:
      return count_bad<uint16_t>(t.data, b, e, 0x7f80, first);
    case DType::kF16:
      return count_bad<uint16_t>(t.data, b, e, 0x7c00, first);
    case DType::kF32:
      return count_bad<uint32_t>(t.data, b, e, 0x7f800000u, first);
    case DType::kF64:
      return count_bad<uint64_t>(t.data, b, e, 0x7ff0000000000000ull, first);
    case DType::kF8E4M3:
      return count_bad<uint8_t>(t.data, b, e, 0x7f, first);  // S.1111.111: NaN (no inf)
    case DType::kF8E5M2:
      return count_bad<uint8_t>(t.data, b, e, 0x7c, first);
    case DType::kF8E8M0:
      return count_bad<uint8_t>(t.data, b, e, 0xff, first);  // 0xff: NaN
    default:
      return 0;
  }
}

double value_at(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, t.data + 2 * i, 2);
      return bf16_to_float(v);
    }
    case DType::kF16: {
      uint16_t v;
      std::memcpy(&v, t.data + 2 * i, 2);
      if (v & 0x3ff) return std::numeric_limits<double>::quiet_NaN();
      return (v & 0x8000) ? -INFINITY : INFINITY;
    }
    case DType::kF32: {
      float v;
      std::memcpy(&v, t.data + 4 * i, 4);
      return v;
    }
    case DType::kF64: {
      double v;
      std::memcpy(&v, t.data + 8 * i, 8);
      return v;
    }
    case DType::kF8E5M2:
      if (t.data[i] & 0x03) return std::numeric_limits<double>::quiet_NaN();
      return (t.data[i] & 0x80) ? -INFINITY : INFINITY;
    default:
      return std::numeric_limits<double>::quiet_NaN();  // e4m3, e8m0: NaN is their only one
  }
}

std::string coordinates(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  return shape_str(c);
}

}  // namespace

bool scanned_dtype(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16:
    case DType::kF32:
    case DType::kF64:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kF8E8M0:
      return true;
    default:
      return false;
  }
}

WeightScan scan_weights(const std::vector<const TensorView*>& tensors, int threads) {
  WeightScan s;
  std::vector<Piece> pieces;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorView& t = *tensors[k];
    if (!scanned_dtype(t.dtype)) continue;
    ++s.tensors;
    s.bytes += int64_t(t.nbytes);
    const int64_t n = int64_t(t.nbytes / dtype_size(t.dtype));
    const int64_t step = std::max<int64_t>(1, kPieceBytes / int64_t(dtype_size(t.dtype)));
    for (int64_t b = 0; b < n; b += step) pieces.push_back({k, b, std::min(n, b + step)});
  }
  std::vector<int64_t> count(pieces.size(), 0), first(pieces.size(), -1);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
      const Piece& p = pieces[i];
      count[i] = count_piece(*tensors[p.tensor], p.begin, p.end, &first[i]);
    }
  };
  int n = threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()));
  n = int(std::min<size_t>(size_t(n), pieces.size()));
  std::vector<std::thread> pool;
  for (int w = 1; w < n; ++w) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();

  // Pieces are in tensor order and, within a tensor, in element order.
  size_t last_bad_tensor = size_t(-1);
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (count[i] == 0) continue;
    s.non_finite += count[i];
    if (pieces[i].tensor != last_bad_tensor) ++s.bad_tensors;
    last_bad_tensor = pieces[i].tensor;
    if (!s.first) {
      s.first = tensors[pieces[i].tensor];
      s.first_index = first[i];
      s.first_value = value_at(*s.first, first[i]);
    }
  }
  return s;
}

std::string describe_non_finite(const WeightScan& s) {
  if (!s.first) return "";
  const TensorView& t = *s.first;
  const char* what = std::isnan(s.first_value) ? "NaN" : s.first_value > 0 ? "inf" : "-inf";
  std::string out = cat("tensor ", excerpt(t.name, 120), " (", dtype_name(t.dtype), " ",
                        shape_str(t.shape), ") holds ", what, " at flat index ", s.first_index);
  if (t.shape.size() > 1) out += cat(" (element ", coordinates(t.shape, s.first_index), ")");
  out += cat("; ", s.non_finite, " non-finite value", s.non_finite == 1 ? "" : "s", " in ",
             s.bad_tensors, " tensor", s.bad_tensors == 1 ? "" : "s");
  return out;
}

void check_weights_finite(const Checkpoint& ckpt, int threads) {
  // Each byte range once: an in-memory checkpoint's aliases (repeated experts) share bytes.
  std::vector<const TensorView*> tensors;
  std::set<std::pair<const uint8_t*, size_t>> seen;
  for (const std::string& n : ckpt.names()) {
    const TensorView& t = ckpt.get(n);
    if (seen.insert({t.data, t.nbytes}).second) tensors.push_back(&t);
  }
  const WeightScan s = scan_weights(tensors, threads);
  DSV4_CHECK(!s.first, ckpt.dir(), ": non-finite weight: ", describe_non_finite(s));
}

}  // namespace dsv4
