// Loading the reference's stored caches (golden_layers "...cache...Lk.*") into our stores,
// and reading ours back in the same shapes.
#pragma once

#include <string>

#include "runtime/block_manager.h"
#include "runtime/host_cache.h"
#include "support/golden.h"

namespace dsv4::test {

// Fills every store of every decoder block of `seq` from `prefix` (e.g.
// "tbt0300.cache_before0297") holding the caches after `tokens` tokens.
void load_golden_caches(const GoldenSet& g, const std::string& prefix, const ModelConfig& c,
                        HostCache& cache, SequenceCache& seq, int64_t tokens);

// The fp32 state rows a golden tensor holds: C4 [rows, width] whole; C128 the `t % 128`
// valid rows only.
std::vector<float> state_kv(HostCache& cache, int block, bool indexer, int slot, int64_t tokens);
std::vector<float> state_score(HostCache& cache, int block, bool indexer, int slot, int64_t tokens);

}  // namespace dsv4::test
