// The KV compressor: gated pooling of `ratio` consecutive tokens per channel (ratio 4 with
// overlapping windows of 8, ratio 128 without), carried across steps in a per-sequence state.
#pragma once

#include "kvcache/cache_layout.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/rope.h"

namespace dsv4::cpu {

struct CompressorWeights {
  int ratio = 4;
  int dim = 512;            // d: output width
  Linear wkv, wgate;        // kF32 [coff*d, model dim]
  std::vector<float> ape;   // [ratio, coff*d]
  std::vector<float> norm;  // [d]
  bool rotate = false;      // indexer compressor: Hadamard + FP4 instead of FP8 NoPE
};

// Writes one token's rows into the state: kv = a, score = g + ape[pos % ratio].
// a, g: [coff*d] fp32 (wkv(x), wgate(x) of that token).
void compressor_store(const CompressorWeights& w, const CompressorStateLayout& l, float* state,
                      int64_t pos, const float* a, const float* g);

// Pools the block that ends at `pos` ((pos+1) % ratio == 0) from the state: per channel, a
// softmax over the block's scores (ratio 4: the previous block's first half then this
// block's second half) weights the kv values; fp32 out [d]. For ratio 4 the current rows
// then become the previous block.
void compressor_pool(const CompressorWeights& w, const CompressorStateLayout& l, float* state,
                     float* pooled);

// Post-processing of a pooled block starting at position `block_start`: BF16, RMSNorm,
// RoPE of the last rope dims at block_start, then the caller's quantisation. Out: BF16
// values [d] (rotate: Hadamard applied, not yet FP4-quantised).
void compressor_finish(const CompressorWeights& w, const RopeTable& rope, float eps,
                       int64_t block_start, const float* pooled, float* out);

}  // namespace dsv4::cpu
