// The endpoints that answer at once, without the engine loop: /v1/models, /tokenize,
// /detokenize (bodies in, JSON out; ApiError on bad input).
#pragma once

#include "server/server_context.h"
#include "tokenizer/python_json.h"

namespace dsv4::server {

// {"object": "list", "data": [{"id": the served name, "object": "model", "max_model_len", ...}]}
tok::ordered_json models_json(const ServerContext& ctx);
// {prompt | messages (+ the chat fields), add_special_tokens} -> {tokens, count, max_model_len}
tok::ordered_json tokenize_json(const ServerContext& ctx, const tok::ordered_json& body);
// {tokens} -> {prompt}
tok::ordered_json detokenize_json(const ServerContext& ctx, const tok::ordered_json& body);

}  // namespace dsv4::server
