#include "server/json_fields.h"

#include <cmath>

#include "core/error.h"
#include "server/api_error.h"

namespace dsv4::server {

ordered_json parse_json_body(const std::string& body) {
  ordered_json j;
  try {
    j = ordered_json::parse(body);
  } catch (const ordered_json::exception& e) {
    throw ApiError(400, cat("the body is not valid JSON: ", e.what()));
  }
  if (!j.is_object()) throw ApiError(400, "the body must be a JSON object");
  return j;
}

JsonFields::JsonFields(const ordered_json& object, std::string where)
    : obj_(object), where_(std::move(where)) {}

void JsonFields::fail(const char* key, const std::string& why) const {
  throw ApiError(400, cat("'", name(key), "' ", why), name(key));
}

const ordered_json* JsonFields::get(const char* key) const {
  auto it = obj_.find(key);
  if (it == obj_.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> JsonFields::boolean(const char* key) const {
  const ordered_json* v = get(key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) fail(key, cat("must be a boolean, not ", v->type_name()));
  return v->get<bool>();
}

std::optional<int64_t> JsonFields::integer(const char* key, int64_t lo, int64_t hi) const {
  const ordered_json* v = get(key);
  if (!v) return std::nullopt;
  int64_t x = 0;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
      fail(key, cat("must be in [", lo, ", ", hi, "]"));
    x = v->get<int64_t>();
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    if (!(std::floor(d) == d && std::fabs(d) < 9e18)) fail(key, "must be an integer");
    x = int64_t(d);
  } else {
    fail(key, cat("must be an integer, not ", v->type_name()));
  }
  if (x < lo || x > hi) fail(key, cat("must be in [", lo, ", ", hi, "], got ", x));
  return x;
}

std::optional<double> JsonFields::number(const char* key, double lo, double hi) const {
  const ordered_json* v = get(key);
  if (!v) return std::nullopt;
  if (!v->is_number()) fail(key, cat("must be a number, not ", v->type_name()));
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    fail(key, cat("must be in [", lo, ", ", hi, "], got ", x));
  return x;
}

std::optional<std::string> JsonFields::string(const char* key) const {
  const ordered_json* v = get(key);
  if (!v) return std::nullopt;
  if (!v->is_string()) fail(key, cat("must be a string, not ", v->type_name()));
  return v->get<std::string>();
}

const ordered_json* JsonFields::object(const char* key) const {
  const ordered_json* v = get(key);
  if (v && !v->is_object()) fail(key, cat("must be an object, not ", v->type_name()));
  return v;
}

const ordered_json* JsonFields::array(const char* key) const {
  const ordered_json* v = get(key);
  if (v && !v->is_array()) fail(key, cat("must be a list, not ", v->type_name()));
  return v;
}

}  // namespace dsv4::server
