// Observation points inside a forward pass: tests and the verify mode receive named
// intermediate tensors (per block, per sequence chunk) without the model knowing who listens.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace dsv4 {

class TraceSink {
 public:
  virtual ~TraceSink() = default;
  // `block`: block index (-1 for model-level tensors), `chunk`: index of the sequence chunk in
  // the batch, `name`: e.g. "attn_in", `data`: row-major float values of `shape`.
  virtual void tensor(int block, int chunk, std::string_view name, const float* data,
                      const std::vector<int64_t>& shape) = 0;
  virtual void ints(int block, int chunk, std::string_view name, const int32_t* data,
                    const std::vector<int64_t>& shape) = 0;
};

}  // namespace dsv4
