#include "server/info_endpoints.h"

#include "core/error.h"
#include "server/api_error.h"
#include "server/json_fields.h"
#include "server/openai_format.h"

namespace dsv4::server {

tok::ordered_json models_json(const ServerContext& ctx) {
  ordered_json m = {{"id", ctx.model_name},
                    {"object", "model"},
                    {"created", unix_time()},
                    {"owned_by", "dsv4"},
                    {"root", ctx.options.engine.model_dir},
                    {"parent", nullptr},
                    {"max_model_len", ctx.parse.info.max_tokens}};
  return {{"object", "list"}, {"data", ordered_json::array({m})}};
}

tok::ordered_json tokenize_json(const ServerContext& ctx, const tok::ordered_json& body) {
  check_model(body, ctx.model_name);
  const JsonFields f(body);
  // DeepSeek-V4's tokenizer adds no special tokens (add_bos_token is false), so for a prompt
  // add_special_tokens changes nothing; for messages, false leaves the rendered BOS out.
  const bool special = f.boolean("add_special_tokens").value_or(true);
  std::vector<int32_t> ids;
  if (f.has("prompt") == f.has("messages"))
    throw ApiError(400, "give exactly one of 'prompt' and 'messages'");
  if (f.has("prompt")) {
    ids = ctx.tokenizer->encode(*f.string("prompt"));
  } else {
    ids = ctx.tokenizer->encode(render_chat_prompt(body, special).text);
  }
  return {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", ctx.parse.info.max_tokens}};
}

tok::ordered_json detokenize_json(const ServerContext& ctx, const tok::ordered_json& body) {
  check_model(body, ctx.model_name);
  const JsonFields f(body);
  const ordered_json* tokens = f.array("tokens");
  if (!tokens) f.fail("tokens", "is required (a list of token ids)");
  std::vector<int32_t> ids;
  const int32_t size = ctx.tokenizer->size();
  for (const ordered_json& t : *tokens) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= size)
      f.fail("tokens", cat("must be a list of token ids in [0, ", size, ")"));
    ids.push_back(t.get<int32_t>());
  }
  return {{"prompt", ctx.tokenizer->decode(ids)}};
}

}  // namespace dsv4::server
