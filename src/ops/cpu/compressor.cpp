#include "ops/cpu/compressor.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/formats.h"
#include "ops/cpu/hadamard.h"
#include "ops/cpu/norm.h"

namespace dsv4::cpu {

void compressor_store(const CompressorWeights& w, const CompressorStateLayout& l, float* state,
                      int64_t pos, const float* a, const float* g) {
  const int j = static_cast<int>(pos % w.ratio);
  const int row = l.coff() == 2 ? w.ratio + j : j;
  const int width = l.width();
  const float* ape = w.ape.data() + size_t(j) * width;
  std::memcpy(state + l.kv_offset(row), a, width * sizeof(float));
  float* s = state + l.score_offset(row);
  for (int c = 0; c < width; ++c) s[c] = g[c] + ape[c];
}

void compressor_pool(const CompressorWeights& w, const CompressorStateLayout& l, float* state,
                     float* pooled) {
  const int d = w.dim, width = l.width(), r = w.ratio;
  const bool overlap = l.coff() == 2;
  const int n = overlap ? 2 * r : r;
  std::vector<float> kv(n), sc(n);
  for (int ch = 0; ch < d; ++ch) {
    for (int t = 0; t < n; ++t) {
      // Overlap: rows [0, r) are the previous block (first half of the channels), rows
      // [r, 2r) the current block (second half).
      const int col = (overlap && t >= r) ? d + ch : ch;
      kv[t] = state[l.kv_offset(t) + col];
      sc[t] = state[l.score_offset(t) + col];
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < n; ++t) mx = std::fmax(mx, sc[t]);
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) {
      sc[t] = std::exp(sc[t] - mx);
      sum += sc[t];
    }
    float acc = 0.0f;
    for (int t = 0; t < n; ++t) acc += kv[t] * (sc[t] / sum);
    pooled[ch] = acc;
  }
  if (overlap) {
    std::memmove(state + l.kv_offset(0), state + l.kv_offset(r), size_t(r) * width * 4);
    std::memmove(state + l.score_offset(0), state + l.score_offset(r), size_t(r) * width * 4);
  }
}

void compressor_finish(const CompressorWeights& w, const RopeTable& rope, float eps,
                       int64_t block_start, const float* pooled, float* out) {
  const int d = w.dim;
  std::vector<float> x(d);
  for (int i = 0; i < d; ++i) x[i] = round_bf16(pooled[i]);
  rms_norm(x.data(), 1, d, w.norm.data(), eps, out);
  std::vector<float> c(rope.rope_dim / 2), s(rope.rope_dim / 2);
  rope.cos_sin(block_start, c.data(), s.data());
  rope_apply(out + d - rope.rope_dim, rope.rope_dim, c.data(), s.data(), false);
  if (w.rotate) hadamard_rotate(out, d);
}

}  // namespace dsv4::cpu
