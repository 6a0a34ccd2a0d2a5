// The OpenAI-compatible HTTP server (cpp-httplib): routes, the API key, body limits and error
// bodies; generation requests go to the engine loop through GenerationSession. HTTP comes up
// first (/health says 503 while the model loads on the engine-loop thread).
//
//   POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize
//   GET  /v1/models, /health, /metrics        (/health and /metrics need no API key)
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "server/server_context.h"

namespace httplib {
class Server;
}

namespace dsv4::server {

class HttpServer {
 public:
  explicit HttpServer(ServerOptions options);
  ~HttpServer();

  // Binds host:port (throws dsv4::Error when it cannot), starts the HTTP threads and the
  // engine loop, which loads the model.
  void start();
  int port() const { return port_; }
  EngineWorker::State state() const { return ctx_.worker->state(); }
  std::string load_error() const { return ctx_.worker->load_error(); }
  // The engine failed after loading (EngineWorker::state()); failure() says why.
  bool engine_failed() const { return ctx_.worker->engine_failed(); }
  std::string failure() const { return ctx_.worker->failure(); }
  const std::string& model_name() const { return ctx_.model_name; }

  // Stops admitting (new generation requests get 503), lets every request in flight finish
  // and its response be written, then stops.
  void shutdown();

 private:
  void routes();

  ServerContext ctx_;
  std::unique_ptr<httplib::Server> http_;
  std::thread listener_;
  int port_ = 0;
};

}  // namespace dsv4::server
