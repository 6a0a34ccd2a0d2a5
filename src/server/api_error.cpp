#include "server/api_error.h"

#include <nlohmann/json.hpp>

namespace dsv4::server {

const char* error_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 404:
      return "not_found_error";
    case 429:
      return "rate_limit_error";
    case 503:
      return "service_unavailable_error";
    default:
      return status >= 500 ? "internal_server_error" : "invalid_request_error";
  }
}

std::string error_body(int status, const std::string& message, const std::string& param) {
  nlohmann::ordered_json e = {
      {"message", message},
      {"type", error_type(status)},
      {"param", param.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(param)},
      {"code", status}};
  return nlohmann::ordered_json{{"error", e}}.dump(-1, ' ', false,
                                                   nlohmann::json::error_handler_t::replace);
}

}  // namespace dsv4::server
