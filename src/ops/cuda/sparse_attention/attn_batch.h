// How the query tokens of one attention/indexer launch map to sequences and positions. Shared
// by the lightning indexer and the sparse attention (both read a sequence's paged caches
// through its block tables).
#pragma once

#include <cstdint>

namespace dsv4::cuda {

// Tokens [cu_seqlens[s], cu_seqlens[s+1]) belong to sequence s (the row s of every block
// table), at consecutive positions seq_pos0[s], seq_pos0[s] + 1, ... (a prefill chunk, or the
// 1-4 tokens of a (speculative) decode step). Device arrays; the host-side bounds size the
// launch and must hold for the device data (they are not re-checked on the device).
struct AttnBatch {
  const int32_t* cu_seqlens = nullptr;  // device [num_seqs + 1], cu_seqlens[0] = 0
  const int32_t* seq_pos0 = nullptr;  // device [num_seqs], position of each sequence's first token
  int num_seqs = 0;
  int num_tokens = 0;        // = cu_seqlens[num_seqs]
  int max_seq_tokens = 0;    // >= max_s (cu_seqlens[s+1] - cu_seqlens[s])
  int64_t max_position = 0;  // >= the largest position of any token
};

}  // namespace dsv4::cuda
