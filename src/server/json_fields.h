// Typed reading of a request body's fields: a wrong type or value is an ApiError (400) naming
// the field. null counts as absent, as OpenAI's clients send it for unset fields.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "tokenizer/python_json.h"

namespace dsv4::server {

using tok::ordered_json;

// The body as a JSON object (400 on invalid JSON, invalid UTF-8 included, or a non-object).
ordered_json parse_json_body(const std::string& body);

class JsonFields {
 public:
  // `where` prefixes field names in errors ("stream_options.").
  explicit JsonFields(const ordered_json& object, std::string where = {});

  const ordered_json* get(const char* key) const;  // nullptr when absent or null
  bool has(const char* key) const { return get(key) != nullptr; }
  std::optional<bool> boolean(const char* key) const;
  std::optional<int64_t> integer(const char* key, int64_t lo, int64_t hi) const;
  std::optional<double> number(const char* key, double lo, double hi) const;
  std::optional<std::string> string(const char* key) const;
  const ordered_json* object(const char* key) const;  // must be an object when present
  const ordered_json* array(const char* key) const;   // must be a list when present

  std::string name(const char* key) const { return where_ + key; }
  [[noreturn]] void fail(const char* key, const std::string& why) const;

 private:
  const ordered_json& obj_;
  std::string where_;
};

}  // namespace dsv4::server
