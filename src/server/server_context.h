// What the HTTP handlers share: the options, the engine loop, the metrics and, once the model
// has loaded, the tokenizer and what parsing needs (immutable from then on).
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "dsv4/engine.h"
#include "server/engine_worker.h"
#include "server/generation_request.h"
#include "server/metrics.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::server {

struct ServerOptions {
  EngineOptions engine;  // model_dir, backend, max_sequences (--max-running), max_tokens
                         // (--max-model-len), cache_bytes, max_step_tokens
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port
  int max_waiting = 128;
  std::string api_key;            // empty: no key needed
  std::string served_model_name;  // empty: the model directory as given
  // The tokenizer.json; empty: the model directory's (random weights have none: required).
  std::string tokenizer_path;
  size_t max_body_bytes = size_t(8) << 20;
  bool forced_output = false;  // the test facility: requests may carry forced_output ids
};

struct ServerContext {
  explicit ServerContext(ServerOptions o);

  const ServerOptions options;
  // served_model_name, else the model directory or "random-weights:PRESET".
  const std::string model_name;
  ServerMetrics metrics;
  std::unique_ptr<EngineWorker> worker;

  // Set by the loop thread before the worker reports kReady; read-only afterwards.
  std::unique_ptr<tok::Tokenizer> tokenizer;
  ParseContext parse;

  std::atomic<bool> draining{false};
  std::atomic<int> active_sessions{0};  // generation responses not finished writing
};

}  // namespace dsv4::server
