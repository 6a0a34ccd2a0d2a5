// Fuzzes the safetensors header validation (SafetensorsFile over bytes). Whatever it accepts
// must keep the promises the loader relies on: every tensor inside the data, its bytes the
// size its shape and dtype say, no two tensors sharing bytes.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const dsv4::SafetensorsFile f("fuzz.safetensors", data, size);
    std::vector<std::pair<const uint8_t*, const uint8_t*>> ranges;
    for (const auto& [name, t] : f.tensors()) {
      if (t.data < data || t.data + t.nbytes > data + size) std::abort();
      if (uint64_t(t.numel()) * dsv4::dtype_size(t.dtype) != t.nbytes) std::abort();
      if (t.nbytes) ranges.emplace_back(t.data, t.data + t.nbytes);
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i)
      if (ranges[i].first < ranges[i - 1].second) std::abort();
  } catch (const dsv4::Error&) {
    // A refusal is fine; crashes, leaks, undefined behaviour and other exceptions are not.
  }
  return 0;
}
