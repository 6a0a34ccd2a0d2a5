#include "support/golden_cache.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "runtime/cache_io.h"

namespace dsv4::test {
namespace {

std::string name(const std::string& prefix, int k, const std::string& what) {
  return prefix + ".L" + std::to_string(k) + "." + what;
}

float* state_ptr(HostCache& cache, int block, bool indexer, int slot) {
  return indexer ? cache.index_state(block, slot) : cache.main_state(block, slot);
}

CompressorStateLayout state_layout(HostCache& cache, int block, bool indexer) {
  return indexer ? cache.index_state_layout() : cache.main_state_layout(block);
}

// Rows the golden keeps: all for ratio 4, the t % 128 written ones for ratio 128.
int golden_rows(const CompressorStateLayout& l, int64_t tokens) {
  return l.ratio == 4 ? l.rows() : static_cast<int>(tokens % l.ratio);
}

void load_state(const GoldenSet& g, const std::string& base, HostCache& cache, int block,
                bool indexer, int slot, int64_t tokens) {
  const CompressorStateLayout l = state_layout(cache, block, indexer);
  float* st = state_ptr(cache, block, indexer, slot);
  std::fill(st, st + l.score_offset(0), 0.0f);
  std::fill(st + l.score_offset(0), st + l.floats(), -std::numeric_limits<float>::infinity());
  const std::vector<float> kv = to_floats(g.get(base + ".kv_state"));
  const std::vector<float> sc = to_floats(g.get(base + ".score_state"));
  const size_t n = size_t(golden_rows(l, tokens)) * l.width();
  DSV4_CHECK(kv.size() == n && sc.size() == n, base, ": state has ", kv.size(),
             " values, expected ", n);
  std::copy(kv.begin(), kv.end(), st + l.kv_offset(0));
  std::copy(sc.begin(), sc.end(), st + l.score_offset(0));
}

std::vector<float> state_rows(HostCache& cache, int block, bool indexer, int slot, int64_t tokens,
                              bool score) {
  const CompressorStateLayout l = state_layout(cache, block, indexer);
  const float* st = state_ptr(cache, block, indexer, slot) + (score ? l.score_offset(0) : 0);
  return std::vector<float>(st, st + size_t(golden_rows(l, tokens)) * l.width());
}

}  // namespace

void load_golden_caches(const GoldenSet& g, const std::string& prefix, const ModelConfig& c,
                        HostCache& cache, SequenceCache& seq, int64_t tokens) {
  for (int k = 0; k < c.n_layers; ++k) {
    write_window(cache, k, seq, to_floats(g.get(name(prefix, k, "window"))).data());
    const int r = c.ratio(k);
    if (r == 0) continue;
    write_compressed(cache, k, seq, to_floats(g.get(name(prefix, k, "compressed"))).data(),
                     tokens / r);
    load_state(g, name(prefix, k, "compressor"), cache, k, false, seq.state_slot, tokens);
    if (r != 4) continue;
    write_index_keys(cache, k, seq, to_floats(g.get(name(prefix, k, "indexer.keys"))).data(),
                     tokens / 4);
    load_state(g, name(prefix, k, "indexer.compressor"), cache, k, true, seq.state_slot, tokens);
  }
  seq.tokens = tokens;
}

std::vector<float> state_kv(HostCache& cache, int block, bool indexer, int slot, int64_t tokens) {
  return state_rows(cache, block, indexer, slot, tokens, false);
}

std::vector<float> state_score(HostCache& cache, int block, bool indexer, int slot,
                               int64_t tokens) {
  return state_rows(cache, block, indexer, slot, tokens, true);
}

}  // namespace dsv4::test
