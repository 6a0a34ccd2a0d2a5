#include "support/golden_cache.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "backends/cpu/cache_io.h"
#include "core/error.h"
#include "core/formats.h"
#include "ops/cpu/cache_codec.h"

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

namespace {

int ordinal(uint8_t code, uint8_t sign_bit) {
  const int mag = code & (sign_bit - 1);
  return (code & sign_bit) ? -mag : mag;
}

bool within_bf16_ulp(float a, float b) {
  int e;
  std::frexp(std::max(std::fabs(a), std::fabs(b)), &e);
  return std::fabs(a - b) <= std::ldexp(1.0f, e - 8) * 1.0001f;
}

// Spacing of BF16 values at |v| (v normal).
float bf16_ulp_of(float v) {
  v = std::fabs(v);
  if (v < 1e-30f) return std::ldexp(1.0f, -133);
  return std::ldexp(1.0f, std::ilogb(v) - 7);
}

StepCheck step_check(int n, int width, const std::vector<float>& ref,
                     const std::function<EntryRef(int)>& entry, bool fp4, int quant_dims, int block,
                     const std::function<void(EntryRef, float*)>& decode) {
  StepCheck r;
  size_t eq = 0, total = 0;
  std::vector<float> ours(width);
  // strict: beyond one step as stored; rounding: also beyond what float rounding explains.
  auto beyond = [&](bool strict, bool rounding, int i, int j, float o, float rv) {
    if (strict && r.beyond_one_step++ == 0)
      r.first_beyond = cat("entry ", i, " dim ", j, ": ours ", o, ", reference ", rv);
    r.beyond_rounding += strict && rounding;
  };
  for (int i = 0; i < n; ++i) {
    const EntryRef e = entry(i);
    decode(e, ours.data());
    for (int j = 0; j < width; ++j, ++total) {
      const float rv = ref[size_t(i) * width + j];
      if (ours[j] == rv) {
        ++eq;
        continue;
      }
      if (j >= quant_dims) {
        // BF16 RoPE dims; the pair is interleaved (j, j ^ 1).
        const float pr = ref[size_t(i) * width + (j ^ 1)];
        const float norm = std::sqrt(rv * rv + pr * pr);
        beyond(!within_bf16_ulp(ours[j], rv), std::fabs(ours[j] - rv) > 1.0001f * bf16_ulp_of(norm),
               i, j, ours[j], rv);
        continue;
      }
      const float scale = e8m0_to_float(e.scales[j / block]);
      int ours_ord, ref_ord;
      if (fp4) {
        const uint8_t byte = e.data[j / 2];
        ours_ord = ordinal(j % 2 ? e2m1_high(byte) : e2m1_low(byte), 8);
        const uint8_t rc = float_to_e2m1(rv / scale);
        if (e2m1_to_float(rc) * scale != rv) {
          beyond(true, true, i, j, ours[j], rv);
          continue;
        }
        ref_ord = ordinal(rc, 8);
      } else {
        ours_ord = ordinal(e.data[j], 0x80);
        const uint8_t rc = float_to_e4m3(rv / scale);
        if (e4m3_to_float(rc) * scale != rv) {
          // Not on our grid: the reference's block scale is another power of two. By value, at
          // the coarser grid's spacing (e4m3: 3 mantissa bits, subnormal step 2^-9).
          const float coarse =
              e4m3_to_float(float_to_e4m3(rv / (2 * scale))) * 2 * scale == rv ? 2 * scale : scale;
          const float mag = std::max(std::fabs(ours[j]), std::fabs(rv)) / coarse;
          const float step =
              coarse * (mag < 0.015625f ? 0.001953125f : std::ldexp(1.0f, std::ilogb(mag) - 3));
          beyond(true, std::fabs(ours[j] - rv) > step * 1.0001f, i, j, ours[j], rv);
          continue;
        }
        ref_ord = ordinal(rc, 0x80);
      }
      const bool far = std::abs(ours_ord - ref_ord) > 1;
      beyond(far, far, i, j, ours[j], rv);
    }
  }
  r.frac_equal = total ? double(eq) / total : 1.0;
  r.elements = total;
  return r;
}

}  // namespace

StepCheck kv_steps(HostCache& c, int k, const SequenceCache& s, int n, bool window,
                   const std::vector<float>& ref) {
  const KvEntryLayout& l = c.kv_layout();
  return step_check(
      n, l.nope_dim + l.rope_dim, ref,
      [&](int i) { return window ? c.window_slot(k, s, i) : c.compressed(k, s, i); }, false,
      l.nope_dim, KvEntryLayout::kQuantBlock,
      [&](EntryRef e, float* out) { cpu::decode_kv_entry(l, e.data, e.scales, out); });
}

StepCheck key_steps(HostCache& c, int k, const SequenceCache& s, int n,
                    const std::vector<float>& ref) {
  const IndexKeyLayout& l = c.index_layout();
  return step_check(
      n, l.dim, ref, [&](int i) { return c.index_key(k, s, i); }, true, l.dim,
      IndexKeyLayout::kQuantBlock,
      [&](EntryRef e, float* out) { cpu::decode_index_key(l, e.data, e.scales, out); });
}

}  // namespace dsv4::test
