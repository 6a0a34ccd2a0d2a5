// One forward step's batch, backend-neutral: any mix of sequences, each bringing one
// contiguous run of tokens (a prefill chunk, or a decode token) at its next positions.
#pragma once

#include <cstdint>

#include <vector>

#include "kvcache/block_manager.h"
#include "model/runner.h"

namespace dsv4 {

// One sequence's tokens in a forward step, at positions start..start+n-1.
struct ChunkRef {
  SequenceCache* cache = nullptr;
  int64_t start = 0;
  const int32_t* tokens = nullptr;
  int n = 0;
};

// A validated step as a runner's forward pass sees it: one chunk per input (input order), the
// token rows whose logits the step computes (`rows`: first the rows StepOutput::logits
// returns, `num_logit_rows` of them, then rows only sampled or scored), and per sampled input
// the index into `rows` of its row and its spec.
struct StepBatch {
  int dp_rank = 0;  // the data-parallel group whose sequences these are
  std::vector<ChunkRef> chunks;
  std::vector<int> rows;
  std::vector<int> row_input;  // the input each entry of `rows` belongs to
  int num_logit_rows = 0;
  std::vector<int> sample_rows;  // indices into `rows`
  std::vector<const SampleSpec*> samples;
  // Per sample: its input (index into `chunks`); for a verify (StepInput::verify > 0) the
  // indices into `rows` of its rows after the first, in order (sample_rows holds the first:
  // the row before the first draft); the drafts to propose after the step.
  std::vector<int> sample_inputs;
  std::vector<std::vector<int>> verify_rows;
  std::vector<int> drafts;
  // Per scored input: per token row, the index into `rows` (-1: not scored).
  struct Score {
    const std::vector<int32_t>* ids = nullptr;
    int top = 0;
    std::vector<int> rows;
  };
  std::vector<Score> scores;
  bool decode_only = false;  // every input one token
};

}  // namespace dsv4
