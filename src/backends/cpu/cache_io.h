// Reading cache stores back as values (the reference's view: BF16 KV rows, fp32 compressor
// states) and loading such values into the stores. Loading requires values the byte layout
// represents exactly (as every reference cache holds) and throws otherwise.
#pragma once

#include <vector>

#include "backends/cpu/host_cache.h"

namespace dsv4 {

// The window ring [window, head_dim], slot order.
std::vector<float> read_window(HostCache& c, int block, const SequenceCache& s);
// Compressed KV entries [count, head_dim].
std::vector<float> read_compressed(HostCache& c, int block, const SequenceCache& s, int64_t count);
// Indexer keys [count, index_dim].
std::vector<float> read_index_keys(HostCache& c, int block, const SequenceCache& s, int64_t count);

void write_window(HostCache& c, int block, const SequenceCache& s, const float* values);
void write_compressed(HostCache& c, int block, const SequenceCache& s, const float* values,
                      int64_t count);
void write_index_keys(HostCache& c, int block, const SequenceCache& s, const float* values,
                      int64_t count);

}  // namespace dsv4
