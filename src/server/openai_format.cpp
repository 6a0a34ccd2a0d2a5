#include "server/openai_format.h"

#include <chrono>
#include <cstdio>
#include <random>

#include "tokenizer/utf8.h"

namespace dsv4::server {

std::string random_id(const std::string& prefix) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  char buf[32];
  std::snprintf(buf, sizeof buf, "%08llx%016llx",
                static_cast<unsigned long long>(rng() & 0xffffffffull),
                static_cast<unsigned long long>(rng()));
  return prefix + (prefix.back() == '_' ? "" : "-") + buf;
}

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string to_text(const ordered_json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

ordered_json usage_json(int64_t prompt, int64_t completion, int64_t cached) {
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

std::string TokenNames::operator()(int32_t id) const {
  if (as_ids) return "token_id:" + std::to_string(id);
  return tok::to_valid_utf8(tokenizer->token_bytes(id));
}

namespace {

ordered_json bytes_json(const std::string& b) {
  ordered_json a = ordered_json::array();
  for (unsigned char c : b) a.push_back(int(c));
  return a;
}

ordered_json chat_entry(const TokenNames& n, int32_t id, float logprob) {
  return {
      {"token", n(id)}, {"logprob", logprob}, {"bytes", bytes_json(n.tokenizer->token_bytes(id))}};
}

int64_t code_points(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace

ordered_json chat_logprobs(const TokenNames& t, const std::vector<TokenLogprob>& lps) {
  ordered_json content = ordered_json::array();
  for (const TokenLogprob& lp : lps) {
    ordered_json e = chat_entry(t, lp.token, lp.logprob);
    ordered_json top = ordered_json::array();
    for (const auto& [id, l] : lp.top) top.push_back(chat_entry(t, id, l));
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return content;
}

void CompletionLogprobs::push(const std::string& text) {
  tokens_.push_back(text);
  offsets_.push_back(offset_);
  offset_ += code_points(text);
}

void CompletionLogprobs::add_unscored(const TokenNames& t, int32_t id) {
  push(t(id));
  logprobs_.push_back(nullptr);
  top_.push_back(nullptr);
}

void CompletionLogprobs::add(const TokenNames& t, const TokenLogprob& lp) {
  push(t(lp.token));
  logprobs_.push_back(lp.logprob);
  ordered_json top = ordered_json::object();
  for (const auto& [id, l] : lp.top) {
    const std::string k = t(id);
    if (!top.contains(k)) top[k] = l;
  }
  top_.push_back(std::move(top));
}

ordered_json CompletionLogprobs::take() {
  ordered_json j = {{"tokens", std::move(tokens_)},
                    {"token_logprobs", std::move(logprobs_)},
                    {"top_logprobs", std::move(top_)},
                    {"text_offset", std::move(offsets_)}};
  tokens_ = logprobs_ = top_ = offsets_ = ordered_json::array();
  return j;
}

ordered_json tool_call_json(const tok::ToolCall& call, const std::string& id) {
  return {{"id", id},
          {"type", "function"},
          {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

}  // namespace dsv4::server
