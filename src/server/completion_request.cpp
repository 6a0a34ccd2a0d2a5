// /v1/completions: a prompt (text, token ids, or a list of either) -> one engine job per prompt.
#include "core/error.h"
#include "server/api_error.h"
#include "server/generation_request.h"
#include "server/sampling_fields.h"

namespace dsv4::server {
namespace {

bool is_id_list(const ordered_json& v) {
  if (!v.is_array() || v.empty()) return false;
  for (const ordered_json& t : v)
    if (!t.is_number_integer()) return false;
  return true;
}

// The prompts as token ids. Text is tokenized as is: DeepSeek-V4's tokenizer adds no BOS
// (add_bos_token is false), so a prompt that wants one writes it.
struct Prompt {
  std::vector<int32_t> ids;
  std::string text;  // as given, or the ids' text
};

std::vector<Prompt> prompts(const JsonFields& f, const ParseContext& ctx) {
  const ordered_json* p = f.get("prompt");
  if (!p) f.fail("prompt", "is required");
  std::vector<const ordered_json*> items;
  if (p->is_string() || is_id_list(*p)) {
    items.push_back(p);
  } else if (p->is_array() && !p->empty()) {
    for (const ordered_json& x : *p) items.push_back(&x);
  } else {
    f.fail("prompt", "must be a string, a list of strings, token ids or lists of token ids");
  }
  std::vector<Prompt> out;
  for (const ordered_json* item : items) {
    if (item->is_string()) {
      const std::string text = item->get<std::string>();
      out.push_back({ctx.tokenizer->encode(text), text});
    } else if (is_id_list(*item)) {
      std::vector<int32_t> ids;
      for (const ordered_json& t : *item) {
        const int64_t id = t.get<int64_t>();
        if (id < 0 || id >= ctx.info.vocab_size)
          f.fail("prompt", cat("token id ", id, " is out of range [0, ", ctx.info.vocab_size, ")"));
        ids.push_back(int32_t(id));
      }
      std::string text = ctx.tokenizer->decode(ids);
      out.push_back({std::move(ids), std::move(text)});
    } else {
      f.fail("prompt", "must be a string, a list of strings, token ids or lists of token ids");
    }
    if (out.back().ids.empty()) f.fail("prompt", "is empty");
  }
  return out;
}

}  // namespace

GenerationRequest parse_completion_request(const ordered_json& body, const ParseContext& ctx) {
  check_model(body, ctx.served_model_name);
  const JsonFields f(body);
  if (f.has("suffix")) f.fail("suffix", "is not supported");
  GenerationRequest r;
  r.echo = f.boolean("echo").value_or(false);
  r.logprobs = int(f.integer("logprobs", 0, 20).value_or(-1));
  Job common;
  parse_common_fields(f, ctx, common, r);
  for (Prompt& p : prompts(f, ctx)) {
    std::vector<int32_t>& ids = p.ids;
    Job job = common;
    job.sampling.max_new_tokens = parse_max_tokens(f, ctx, int64_t(ids.size()), 0, "prompt");
    if (r.logprobs >= 0) {
      job.sampling.logprobs = true;
      job.sampling.top_logprobs = r.logprobs;
      if (r.echo) job.sampling.prompt_logprobs = r.logprobs;
    }
    if (r.echo) r.prompt_text.push_back(std::move(p.text));
    job.prompt = std::move(ids);
    r.jobs.push_back(std::move(job));
  }
  if (r.jobs.size() > 1 && f.has("seed") == false) {
    // Each prompt draws on its own (they all got the request's one fresh seed).
    for (size_t i = 1; i < r.jobs.size(); ++i) r.jobs[i].sampling.seed ^= 0x9E3779B97F4A7C15ull * i;
  }
  return r;
}

}  // namespace dsv4::server
