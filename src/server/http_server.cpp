#include "server/http_server.h"

#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>

#include "core/error.h"
#include "server/api_error.h"
#include "server/generation_session.h"
#include "server/info_endpoints.h"
#include "server/openai_format.h"

namespace dsv4::server {
namespace {

// cpp-httplib listens with a backlog of CPPHTTPLIB_LISTEN_BACKLOG, compiled into Debian's
// library as 5: a burst of connections (64 or 256 clients starting at once) overflows the
// accept queue, and Linux drops the handshakes beyond it, so those clients retry seconds later
// or see resets. listen() again on the bound socket widens its queue (Linux keeps the socket and
// takes the new backlog); the socket is the one listening on `port` (the library keeps its
// descriptor private). Returns whether one was found.
bool widen_listen_backlog(int port) {
  bool found = false;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    int fd = -1;
    try {
      fd = std::stoi(e.path().filename().string());
    } catch (const std::exception&) {
      continue;
    }
    int listening = 0;
    socklen_t len = sizeof listening;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) continue;
    sockaddr_storage addr{};
    len = sizeof addr;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) continue;
    int bound = -1;
    if (addr.ss_family == AF_INET) bound = ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    if (addr.ss_family == AF_INET6)
      bound = ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
    if (bound == port && ::listen(fd, SOMAXCONN) == 0) found = true;
  }
  return found;
}

using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;

void send_error(httplib::Response& res, int status, const std::string& message,
                const std::string& param = {}) {
  res.status = status;
  res.set_content(error_body(status, message, param), "application/json");
}

void send_json(httplib::Response& res, const ordered_json& j) {
  res.status = 200;
  res.set_content(to_text(j), "application/json");
}

}  // namespace

HttpServer::HttpServer(ServerOptions options)
    : ctx_(std::move(options)), http_(std::make_unique<httplib::Server>()) {}

HttpServer::~HttpServer() {
  if (http_->is_running()) http_->stop();
  if (listener_.joinable()) listener_.join();
}

void HttpServer::routes() {
  httplib::Server& s = *http_;
  const ServerOptions& o = ctx_.options;
  // Each connection holds a thread while it is open: room for every request that may run or
  // wait, and for the requests that answer at once (health, metrics, 429s).
  const size_t threads = size_t(o.engine.max_sequences) + size_t(o.max_waiting) + 32;
  s.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  s.set_payload_max_length(o.max_body_bytes);
  s.set_keep_alive_max_count(1000);
  s.set_write_timeout(60, 0);
  // Streams are many small writes (an SSE event per step): sent at once, not held by Nagle's
  // algorithm until the client's (delayed) ACK of the previous one.
  s.set_tcp_nodelay(true);

  s.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req,
                                                                  httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string msg;
    if (res.status == 404)
      msg = cat("no route for ", req.method, " ", req.path);
    else if (res.status == 413)
      msg = cat("the request body exceeds the limit of ", ctx_.options.max_body_bytes, " bytes");
    else
      msg = cat("HTTP ", res.status);
    res.set_content(error_body(res.status, msg), "application/json");
    return httplib::Server::HandlerResponse::Handled;
  }));

  // Guards a handler: the API key, the model being loaded, errors as OpenAI error bodies.
  auto guard = [this](bool needs_key, bool needs_model, Handler h) -> Handler {
    return [this, needs_key, needs_model, h](const httplib::Request& req, httplib::Response& res) {
      try {
        if (needs_key && !ctx_.options.api_key.empty() &&
            req.get_header_value("Authorization") != "Bearer " + ctx_.options.api_key)
          throw ApiError(401, "a valid API key is needed (Authorization: Bearer <key>)");
        if (needs_model) {
          if (ctx_.draining) throw ApiError(503, "the server is shutting down");
          const EngineWorker::State st = ctx_.worker->state();
          if (st == EngineWorker::State::kLoading) throw ApiError(503, "the model is loading");
          if (st == EngineWorker::State::kFailed) throw ApiError(503, ctx_.worker->failure());
        }
        h(req, res);
      } catch (const ApiError& e) {
        send_error(res, e.status(), e.what(), e.param());
      } catch (const Error& e) {
        send_error(res, 400, e.what());
      } catch (const std::exception& e) {
        send_error(res, 500, e.what());
      }
    };
  };

  auto generate = [this](GenerationSession::Api api) -> Handler {
    return [this, api](const httplib::Request& req, httplib::Response& res) {
      const ordered_json body = parse_json_body(req.body);
      GenerationRequest g = api == GenerationSession::Api::kChat
                                ? parse_chat_request(body, ctx_.parse)
                                : parse_completion_request(body, ctx_.parse);
      auto session = std::make_shared<GenerationSession>(ctx_, std::move(g), api);
      session->start();
      if (std::string(session->content_type()) == "text/event-stream")
        res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          session->content_type(),
          [session](size_t, httplib::DataSink& sink) {
            const std::string text = session->poll(std::chrono::milliseconds(50));
            if (!text.empty() && !sink.write(text.data(), text.size())) {
              session->abort();
              return false;
            }
            if (session->done()) {
              if (session->failed()) return false;  // no body can tell: drop the connection
              sink.done();
              return true;
            }
            // A client that went away cancels its request (its cache pages are freed).
            if (text.empty() && !sink.is_writable()) {
              session->abort();
              return false;
            }
            return true;
          },
          [session](bool success) {
            if (!success) session->abort();
          });
    };
  };

  s.Post("/v1/chat/completions", guard(true, true, generate(GenerationSession::Api::kChat)));
  s.Post("/v1/completions", guard(true, true, generate(GenerationSession::Api::kCompletions)));
  s.Get("/v1/models", guard(true, true, [this](const httplib::Request&, httplib::Response& res) {
          send_json(res, models_json(ctx_));
        }));
  s.Post("/tokenize",
         guard(true, true, [this](const httplib::Request& req, httplib::Response& res) {
           send_json(res, tokenize_json(ctx_, parse_json_body(req.body)));
         }));
  s.Post("/detokenize",
         guard(true, true, [this](const httplib::Request& req, httplib::Response& res) {
           send_json(res, detokenize_json(ctx_, parse_json_body(req.body)));
         }));
  s.Get("/health", guard(false, true, [](const httplib::Request&, httplib::Response& res) {
          res.status = 200;
        }));
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(ctx_.metrics.render(ctx_.worker->snapshot().stats, ctx_.model_name),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
}

void HttpServer::start() {
  routes();
  const ServerOptions& o = ctx_.options;
  if (o.port == 0) {
    port_ = http_->bind_to_any_port(o.host);
    DSV4_CHECK(port_ > 0, "cannot listen on ", o.host, " (any port)");
  } else {
    DSV4_CHECK(http_->bind_to_port(o.host, o.port), "cannot listen on ", o.host, ":", o.port,
               " (in use, or not an address of this machine?)");
    port_ = o.port;
  }
  if (!widen_listen_backlog(port_))
    std::fprintf(stderr, "dsv4 serve: warning: could not widen the listen backlog of port %d\n",
                 port_);
  listener_ = std::thread([this] { http_->listen_after_bind(); });
  ctx_.worker->start();
}

void HttpServer::shutdown() {
  ctx_.draining = true;
  ctx_.worker->stop_admitting();
  // In flight: admitted requests still running, and responses still being written.
  while (ctx_.active_sessions > 0 || ctx_.worker->snapshot().in_flight > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  http_->stop();
  if (listener_.joinable()) listener_.join();
}

}  // namespace dsv4::server
