// A step's samples and scores drawn on the host from its computed logits rows, with the
// reference sampler: the CPU runner's way (the CUDA runner samples on the device,
// ops/cuda/sampling, and shares only the error text below).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/model_config.h"
#include "model/runner.h"
#include "model/step.h"

namespace dsv4 {

// `logits`: [batch.rows.size(), vocab], row i for batch.rows[i]. Returns the samples and
// scores; StepOutput::logits is left to the caller. An input any of whose rows holds a
// non-finite logit gets an error (`errors`, when given, holds errors the caller found
// already, one per input) and no samples or scores.
StepOutput sample_on_host(const StepBatch& batch, const float* logits, int vocab,
                          std::vector<std::string> errors = {});

// A verify's samples after the first: `rows` are its rows (first: the row before the first
// draft; the first's sample is `first`), `drafts` the draft tokens. Row j samples output index
// s.index + j exactly as plain decoding does (same counter-based draw, penalties counting the
// samples before it); it runs only while the sample before it equals the draft it stands on.
// So the emitted tokens are plain decoding's, at every temperature: with a deterministic
// draft d (the MTP block's argmax), accepting d when the plain draw picks it is rejection
// sampling with a point-mass proposal (accept with p(d) = min(1, p(d)/q(d)); on rejection the
// draw is distributed as p without d, the normalised max(0, p - q)), the uniforms being the
// exponential race's u(seed, index, token) of sampling.h.
std::vector<SampledToken> verify_samples(const float* logits, int vocab,
                                         const std::vector<int>& rows, const int32_t* drafts,
                                         const SampleSpec& s, const SampledToken& first);

// The error of an input whose logits row at `position` holds a non-finite value, the first at
// `vocab_id` (both backends write it).
std::string nonfinite_logits_error(int64_t position, int vocab_id, float value);

// Per input of the batch: empty, or the error naming the first position whose hidden state
// went non-finite and the block it happened in (`first_nonfinite`: per token row, from
// CpuModel::forward).
std::vector<std::string> nonfinite_errors(const ModelConfig& config, const StepBatch& batch,
                                          const std::vector<int>& first_nonfinite);

}  // namespace dsv4
