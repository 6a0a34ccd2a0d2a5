// dsv4 serve --model DIR [--backend cpu|cuda] [--host H] [--port P] [--max-running N]
//            [--max-waiting N] [--max-step-tokens N] [--max-model-len N] [--cache-mb N]
//            [--api-key K] [--served-model-name NAME] [--page-size P] [--test-forced-output]
// The OpenAI-compatible server (src/server/). HTTP comes up first, the model loads on the
// engine-loop thread, and the URL is printed once it is ready. SIGTERM or SIGINT: stop
// admitting, finish the requests in flight, exit 0.
#include <signal.h>

#include <cstdio>
#include <ctime>
#include <string>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "server/http_server.h"
#if defined(DSV4_WITH_CUDA)
#include "backends/cuda/backend.h"
#endif

namespace dsv4::cli {

int cmd_serve(const Argv& argv) {
  Args a(argv,
         {"--model", "--backend", "--host", "--port", "--max-running", "--max-waiting",
          "--max-step-tokens", "--max-model-len", "--cache-mb", "--api-key", "--served-model-name",
          "--page-size"},
         {"--test-forced-output"});
  server::ServerOptions o;
  o.engine.model_dir = a.str("--model");
  o.engine.backend = a.opt("--backend").value_or("cpu");
  o.host = a.opt("--host").value_or("127.0.0.1");
  const int64_t port = a.integer("--port", 8000);
  DSV4_CHECK(port >= 0 && port <= 65535, "--port must be in [0, 65535] (0: any free port)");
  o.port = int(port);
  const int64_t running = a.integer("--max-running", 16);
  DSV4_CHECK(running >= 1 && running <= 4096, "--max-running must be in [1, 4096]");
  o.engine.max_sequences = int(running);
  const int64_t waiting = a.integer("--max-waiting", 128);
  DSV4_CHECK(waiting >= 0 && waiting <= 65536, "--max-waiting must be in [0, 65536]");
  o.max_waiting = int(waiting);
  const int64_t step = a.integer("--max-step-tokens", 0);
  DSV4_CHECK(step >= 0 && step <= (1 << 24), "--max-step-tokens must be in [0, 2^24] (0: auto)");
  o.engine.max_step_tokens = int(step);
  const int64_t len = a.integer("--max-model-len", 4096);
  DSV4_CHECK(len >= 2 && len <= (int64_t(1) << 24), "--max-model-len must be in [2, 2^24]");
  o.engine.max_tokens = len;
  const int64_t cache_mb = a.integer("--cache-mb", 0);
  DSV4_CHECK(cache_mb >= 0 && cache_mb <= (int64_t(1) << 30),
             "--cache-mb must be >= 0 (0: room for --max-running sequences of --max-model-len)");
  o.engine.cache_bytes = cache_mb << 20;
  const int64_t page = a.integer("--page-size", 64);
  DSV4_CHECK(page >= 1 && page <= 4096, "--page-size must be in [1, 4096]");
  o.engine.page_size = int(page);
  o.api_key = a.opt("--api-key").value_or("");
  o.served_model_name = a.opt("--served-model-name").value_or("");
  DSV4_CHECK(!a.has("--served-model-name") || !o.served_model_name.empty(),
             "--served-model-name must not be empty");
  o.forced_output = a.has("--test-forced-output");
#if defined(DSV4_WITH_CUDA)
  register_cuda_backend();
#endif

  // Signals are taken by this thread alone (sigtimedwait below); a client that disconnects
  // mid-write must not kill the process.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  server::HttpServer server(o);
  server.start();
  const std::string url = cat("http://", o.host, ":", server.port());
  std::printf("dsv4 serve: listening on %s, loading %s\n", url.c_str(), o.engine.model_dir.c_str());
  std::fflush(stdout);
  bool ready = false;
  const timespec tick{0, 100 * 1000 * 1000};
  for (;;) {
    const int sig = sigtimedwait(&stop_signals, nullptr, &tick);
    if (sig == SIGTERM || sig == SIGINT) break;
    const auto state = server.state();
    if (state == server::EngineWorker::State::kFailed)
      throw Error(cat("cannot serve ", o.engine.model_dir, ": ", server.load_error()));
    if (state == server::EngineWorker::State::kReady && !ready) {
      ready = true;
      std::printf("dsv4 serve: ready: model '%s' at %s/v1\n", server.model_name().c_str(),
                  url.c_str());
      std::fflush(stdout);
    }
  }
  std::printf("dsv4 serve: stopping: finishing the requests in flight\n");
  std::fflush(stdout);
  server.shutdown();
  std::printf("dsv4 serve: stopped\n");
  return 0;
}

}  // namespace dsv4::cli
