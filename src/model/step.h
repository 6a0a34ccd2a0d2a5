// One forward step's batch, backend-neutral: any mix of sequences, each bringing one
// contiguous run of tokens (a prefill chunk, or a decode token) at its next positions.
#pragma once

#include <cstdint>

#include "kvcache/block_manager.h"

namespace dsv4 {

// One sequence's tokens in a forward step, at positions start..start+n-1.
struct ChunkRef {
  SequenceCache* cache = nullptr;
  int64_t start = 0;
  const int32_t* tokens = nullptr;
  int n = 0;
};

}  // namespace dsv4
