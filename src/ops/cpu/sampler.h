// The reference sampler (ops/common/sampling.h gives the rules): one row of fp32 logits to the
// chosen token, its logprob and the top alternatives.
#pragma once

#include <cstdint>

#include "ops/common/sampling.h"

namespace dsv4::cpu {

// `index`: the request's output-token index (the draw's counter); `counts`: the history the
// penalties use (null: none); `forced` >= 0: that token is emitted instead of the draw (the
// server's test facility), with its own logprob.
SampledToken sample_row(const float* logits, int vocab, const SamplingParams& p, int64_t index,
                        const TokenCounts* counts, int32_t forced = -1);

// The logprob of `token` in the raw row (log-softmax) and the `top` most likely ids.
SampledToken score_row(const float* logits, int vocab, int32_t token, int top);

// The first index of the largest value.
int32_t argmax(const float* x, int n);

}  // namespace dsv4::cpu
