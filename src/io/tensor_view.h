// A read-only, typed view of one tensor's bytes (e.g. inside a memory-mapped file).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace dsv4 {

struct TensorView {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(data);
  }
};

// "[a, b, c]"
std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace dsv4
