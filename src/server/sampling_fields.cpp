#include "server/sampling_fields.h"

#include <limits>
#include <random>

#include "core/error.h"
#include "server/api_error.h"

namespace dsv4::server {
namespace {

constexpr int64_t kMaxN = 128;

std::vector<std::string> parse_stop(const JsonFields& f) {
  const ordered_json* v = f.get("stop");
  if (!v) return {};
  std::vector<std::string> out;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    for (const ordered_json& s : *v) {
      if (!s.is_string()) f.fail("stop", "must be a string or a list of strings");
      out.push_back(s.get<std::string>());
    }
  } else {
    f.fail("stop", "must be a string or a list of strings");
  }
  for (const std::string& s : out)
    if (s.empty()) f.fail("stop", "must not hold an empty string");
  return out;
}

std::vector<int32_t> parse_ids(const JsonFields& f, const char* key, int vocab) {
  std::vector<int32_t> out;
  const ordered_json* v = f.array(key);
  if (!v) return out;
  for (const ordered_json& t : *v) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab)
      f.fail(key, cat("must be a list of token ids in [0, ", vocab, ")"));
    out.push_back(t.get<int32_t>());
  }
  return out;
}

}  // namespace

void parse_common_fields(const JsonFields& f, const ParseContext& ctx, Job& job,
                         GenerationRequest& r) {
  SamplingOptions& s = job.sampling;
  const int vocab = ctx.info.vocab_size;
  s.temperature = float(f.number("temperature", 0, 1e4).value_or(ctx.temperature));
  s.top_p = float(f.number("top_p", 0, 1).value_or(ctx.top_p));
  if (s.top_p <= 0) f.fail("top_p", "must be in (0, 1]");
  const int64_t top_k =
      f.integer("top_k", -1, std::numeric_limits<int32_t>::max()).value_or(ctx.top_k);
  s.top_k = top_k < 0 ? 0 : int(top_k);  // -1: off, as vLLM
  s.min_p = float(f.number("min_p", 0, 1).value_or(0));
  s.presence_penalty = float(f.number("presence_penalty", -2, 2).value_or(0));
  s.frequency_penalty = float(f.number("frequency_penalty", -2, 2).value_or(0));
  s.repetition_penalty = float(f.number("repetition_penalty", 1e-6, 1e6).value_or(1));
  // No seed: a fresh one per request (OpenAI's default is a non-reproducible draw).
  if (const auto seed = f.integer("seed", std::numeric_limits<int64_t>::min(),
                                  std::numeric_limits<int64_t>::max()))
    s.seed = uint64_t(*seed);
  else
    s.seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  if (const ordered_json* bias = f.object("logit_bias")) {
    for (const auto& [key, value] : bias->items()) {
      int64_t id = -1;
      try {
        size_t used = 0;
        id = std::stoll(key, &used);
        if (used != key.size()) id = -1;
      } catch (const std::exception&) {
      }
      if (id < 0 || id >= vocab)
        f.fail("logit_bias", cat("key '", key, "' is not a token id in [0, ", vocab, ")"));
      if (!value.is_number() || value.get<double>() < -100 || value.get<double>() > 100)
        f.fail("logit_bias", cat("value of token ", key, " must be a number in [-100, 100]"));
      s.logit_bias.emplace_back(int32_t(id), value.get<float>());
    }
  }
  s.stop_at_eos = !f.boolean("ignore_eos").value_or(false);
  s.stop_token_ids = parse_ids(f, "stop_token_ids", vocab);
  r.stop = parse_stop(f);
  r.tokens_as_ids = f.boolean("return_tokens_as_token_ids").value_or(false);
  job.n = int(f.integer("n", 1, kMaxN).value_or(1));
  if (const auto best_of = f.integer("best_of", 1, kMaxN); best_of && *best_of != job.n)
    f.fail("best_of", "other than n is not supported");
  r.stream = f.boolean("stream").value_or(false);
  if (const ordered_json* so = f.object("stream_options")) {
    if (!r.stream) f.fail("stream_options", "is only allowed with stream: true");
    r.include_usage = JsonFields(*so, "stream_options.").boolean("include_usage").value_or(false);
  }
  // Speculative decoding: at most this many drafts per step for this request (0: off; the
  // server's --speculative-tokens caps it).
  if (const auto k = f.integer("speculative_tokens", 0, kMaxSpeculativeTokens))
    s.speculative_tokens = int(*k);
  if (f.has("forced_drafts")) {
    if (!ctx.forced_output_enabled)
      f.fail("forced_drafts",
             "is a test facility the server enables with --test-forced-output only");
    s.forced_drafts = parse_ids(f, "forced_drafts", vocab);
  }
  if (f.has("forced_output")) {
    if (!ctx.forced_output_enabled)
      f.fail("forced_output",
             "is a test facility the server enables with --test-forced-output only");
    s.forced_output = parse_ids(f, "forced_output", vocab);
  }
}

int64_t parse_max_tokens(const JsonFields& f, const ParseContext& ctx, int64_t prompt_tokens,
                         int64_t min, const char* prompt_field) {
  const int64_t limit = ctx.info.max_tokens;
  if (prompt_tokens > limit || (min > 0 && prompt_tokens >= limit))
    throw ApiError(400,
                   cat("the prompt has ", prompt_tokens, " tokens, which leaves no room for ",
                       "output within --max-model-len ", limit),
                   prompt_field);
  std::optional<int64_t> n = f.integer("max_completion_tokens", min, limit);
  if (!n) n = f.integer("max_tokens", min, limit);
  if (!n) return limit - prompt_tokens;
  if (prompt_tokens + *n > limit)
    throw ApiError(400,
                   cat("the prompt (", prompt_tokens, " tokens) plus max_tokens ", *n,
                       " exceeds --max-model-len ", limit),
                   f.has("max_completion_tokens") ? "max_completion_tokens" : "max_tokens");
  return *n;
}

}  // namespace dsv4::server
