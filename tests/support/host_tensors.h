// Checkpoint-like tensors in host memory for tests and benchmarks that build weights without
// a file: each add() keeps the bytes and returns a view of them that stays valid (the deques
// never move their elements).
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "io/tensor_view.h"

namespace dsv4::test {

struct HostTensors {
  std::deque<std::vector<uint8_t>> data;
  std::deque<TensorView> views;

  const TensorView* add(const std::string& name, DType dt, std::vector<int64_t> shape,
                        std::vector<uint8_t> bytes) {
    data.push_back(std::move(bytes));
    TensorView v;
    v.name = name;
    v.dtype = dt;
    v.shape = std::move(shape);
    v.data = data.back().data();
    v.nbytes = data.back().size();
    views.push_back(v);
    return &views.back();
  }
};

// The bytes of a vector of trivially copyable values.
template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

}  // namespace dsv4::test
