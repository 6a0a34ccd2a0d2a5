// The fields chat completions and completions share: sampling parameters, seed, logit_bias,
// stop strings and token ids, n, stream / stream_options, max_tokens and the forced-output
// test facility.
#pragma once

#include "server/generation_request.h"

namespace dsv4::server {

// Fills job.sampling (all but max_new_tokens and logprobs), job.n, r.stop, r.stream and
// r.include_usage from the body.
void parse_common_fields(const JsonFields& f, const ParseContext& ctx, Job& job,
                         GenerationRequest& r);

// max_completion_tokens / max_tokens, or what is left of --max-model-len after the prompt.
// `min` is 1 for chat, 0 for completions (echo scoring); `prompt_field` names the prompt in
// errors ("messages", "prompt").
int64_t parse_max_tokens(const JsonFields& f, const ParseContext& ctx, int64_t prompt_tokens,
                         int64_t min, const char* prompt_field);

}  // namespace dsv4::server
