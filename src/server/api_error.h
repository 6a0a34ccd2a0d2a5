// Errors a client sees: an HTTP status with an OpenAI-style body
// {"error": {"message", "type", "param", "code"}}.
#pragma once

#include <stdexcept>
#include <string>

namespace dsv4::server {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message, std::string param = {})
      : std::runtime_error(message), status_(status), param_(std::move(param)) {}
  int status() const { return status_; }
  const std::string& param() const { return param_; }

 private:
  int status_;
  std::string param_;
};

// "invalid_request_error" (400, 413), "authentication_error" (401), "not_found_error" (404),
// "rate_limit_error" (429), "service_unavailable_error" (503), "internal_server_error" (5xx).
const char* error_type(int status);

// The JSON body for an error (one line).
std::string error_body(int status, const std::string& message, const std::string& param = {});

}  // namespace dsv4::server
