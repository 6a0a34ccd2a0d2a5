// Loading the reference's stored caches (golden_layers "...cache...Lk.*") into our stores,
// and reading ours back in the same shapes.
#pragma once

#include <string>
#include <vector>

#include "backends/cpu/host_cache.h"
#include "kvcache/block_manager.h"
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

// Stored entries against the reference's values [n, width]: the fraction of elements equal,
// and how many others are more than one step of their format apart.
//  - beyond_one_step (strict): for quantised dims, our stored code against the code the
//    reference value has at our block's scale (a reference value not on that grid counts as
//    beyond); for the BF16 RoPE dims, one ulp.
//  - beyond_rounding: the same, except for what one float-rounding difference upstream explains
//    (for a backend that sums in another order than the reference): a RoPE dim may differ by one
//    ulp of its pair's norm (RoPE keeps the norm; x cos - y sin can cancel), and a quantised
//    element whose block scale flipped a power of two is judged by value at the coarser grid.
struct StepCheck {
  double frac_equal = 1;
  size_t elements = 0;
  size_t beyond_one_step = 0;
  size_t beyond_rounding = 0;  // <= beyond_one_step
  std::string first_beyond;    // the first strict offender, for the log
};
// Window slots (window) or compressed entries 0..n-1 of block k.
StepCheck kv_steps(HostCache& cache, int k, const SequenceCache& s, int n, bool window,
                   const std::vector<float>& ref);
// Indexer keys 0..n-1 of block k.
StepCheck key_steps(HostCache& cache, int k, const SequenceCache& s, int n,
                    const std::vector<float>& ref);

}  // namespace dsv4::test
