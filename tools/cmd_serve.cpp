// dsv4 serve: the OpenAI-compatible server (src/server/).
#include <signal.h>

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <string>

#include "args.h"
#include "commands.h"
#include "common.h"
#include "core/error.h"
#include "prompt_input.h"
#if defined(DSV4_WITH_SERVER)
#include "server/http_server.h"
#endif
#if defined(DSV4_WITH_CUDA)
#include "backends/cuda/backend.h"
#endif

namespace dsv4::cli {

namespace {

#if !defined(DSV4_WITH_SERVER)
int run(const Args&) {
  throw Error("this build has no server (configured with -DDSV4_SERVER=OFF; it needs cpp-httplib)");
}
#else
int run(const Args& a) {
  server::ServerOptions o;
  model_options(a, o.engine);
  if (a.has("--tokenizer")) {
    o.tokenizer_path = a.str("--tokenizer");
    DSV4_CHECK(std::filesystem::is_regular_file(o.tokenizer_path), "--tokenizer ", o.tokenizer_path,
               ": not a file");
    // As make-tiny --tokenizer, checked here, before the weights are generated (the server's
    // own check comes only once the model is loaded).
    if (!o.engine.random_weights.preset.empty())
      o.engine.random_weights.vocab = vocab_for_tokenizer(a, o.tokenizer_path);
  }
  DSV4_CHECK(!o.engine.random_weights.preset.empty() || a.has("--model"), "internal: no model");
  DSV4_CHECK(o.engine.random_weights.preset.empty() || a.has("--tokenizer"),
             "--random-weights: serving needs a tokenizer (give --tokenizer FILE)");
  o.engine.backend = a.str("--backend");
  o.host = a.str("--host");
  o.port = static_cast<int>(a.integer("--port"));
  o.engine.max_sequences = static_cast<int>(a.integer("--max-running"));
  o.max_waiting = static_cast<int>(a.integer("--max-waiting"));
  o.engine.max_step_tokens = static_cast<int>(a.integer("--max-step-tokens"));
  o.engine.max_tokens = a.integer("--max-model-len");
  o.engine.cache_bytes = a.integer("--cache-mb") << 20;
  o.engine.page_size = static_cast<int>(a.integer("--page-size"));
  speculative_options(a, o.engine);
  o.engine.cuda_graphs = !a.has("--no-cuda-graphs");
  o.engine.exact_linears = a.has("--exact-linears");
  parallel_options(a, o.engine);
  if (o.engine.backend != "cuda")
    DSV4_CHECK(o.engine.cuda_graphs && !o.engine.exact_linears,
               "--no-cuda-graphs and --exact-linears apply to --backend cuda");
  o.api_key = a.opt("--api-key").value_or("");
  o.served_model_name = a.opt("--served-model-name").value_or("");
  DSV4_CHECK(!a.has("--served-model-name") || !o.served_model_name.empty(),
             "--served-model-name must not be empty");
  o.forced_output = a.has("--test-forced-output");
  // A node > 0 serves nobody: it runs its ranks for node 0 (which has the HTTP server, the
  // tokenizer and the engine loop) until node 0 stops.
  if (run_as_follower(o.engine)) return 0;
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
  std::printf("dsv4 serve: listening on %s, loading %s\n", url.c_str(),
              server.model_name().c_str());
  std::fflush(stdout);
  bool ready = false;
  constexpr time_t kFailedLingerS = 2;
  const timespec tick{0, 100 * 1000 * 1000};
  for (;;) {
    const int sig = sigtimedwait(&stop_signals, nullptr, &tick);
    if (sig == SIGTERM || sig == SIGINT) break;
    const auto state = server.state();
    if (state == server::EngineWorker::State::kFailed && server.engine_failed()) {
      // Every request in flight has failed with the error. /health says 503 for a moment (a
      // balancer polling it sees why before the port closes; SIGTERM cuts it short), the
      // responses go out, then the process exits non-zero.
      std::printf("dsv4 serve: stopping: the engine failed\n");
      std::fflush(stdout);
      const timespec linger{kFailedLingerS, 0};
      sigtimedwait(&stop_signals, nullptr, &linger);
      server.shutdown();
      throw Error(server.failure());
    }
    if (state == server::EngineWorker::State::kFailed)
      throw Error(cat("cannot serve ", server.model_name(), ": ", server.load_error()));
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

#endif

}  // namespace

const Command& serve_command() {
  static const Command c{
      "serve",
      "the OpenAI-compatible HTTP server",
      "dsv4 serve (--model DIR | --random-weights PRESET --tokenizer FILE) [flags]",
      "Serves /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, /tokenize and\n"
      "/detokenize (README: Serving). HTTP comes up first, the model loads on the engine-loop\n"
      "thread, and the URL is printed once it is ready. SIGTERM or SIGINT: stop admitting, finish\n"
      "the requests in flight, exit 0.",
      model_flags("the model directory (config.json, *.safetensors, tokenizer.json)") +
          std::vector<Flag>{
              {"--tokenizer", "FILE",
               "the tokenizer.json to serve with (default: the model directory's; with "
               "--random-weights required, and the vocabulary unless --vocab)"},
              {"--backend",
               "NAME",
               "the backend that runs the model",
               "cpu",
               false,
               {"cpu", "cuda"}},
              {"--host", "H", "the address to listen on", "127.0.0.1"},
              {"--port",
               "P",
               "the port to listen on, 0 = any free port",
               "8000",
               false,
               {},
               0,
               65535},
              {"--max-running",
               "N",
               "requests' sequences running at once",
               "16",
               false,
               {},
               1,
               4096},
              {"--max-waiting",
               "N",
               "requests waiting for admission (429 beyond)",
               "128",
               false,
               {},
               0,
               65536},
              {"--max-step-tokens",
               "N",
               "tokens per forward step, 0 = the backend's default",
               "0",
               false,
               {},
               0,
               1 << 24},
              {"--max-model-len",
               "N",
               "tokens per sequence (prompt + output)",
               "4096",
               false,
               {},
               2,
               1 << 24},
              {"--cache-mb",
               "N",
               "cache pool size in MiB, 0 = room for --max-running sequences",
               "0",
               false,
               {},
               0,
               1 << 30},
              {"--page-size", "P", "cache entries per page", "64", false, {}, 1, 4096},
              speculative_flag(),
              speculative_rollback_flag(),
              {"--api-key", "K",
               "clients must send 'Authorization: Bearer K' (not for /health, /metrics)"},
              {"--served-model-name", "NAME",
               "the model name of requests and responses (default: --model as given)"},
              {"--no-cuda-graphs", "", "cuda: run decode steps eagerly"},
              {"--exact-linears", "", "cuda: FP8 linears summed as the reference does (W8A16)"},
              {"--test-forced-output", "", "tests only: honour the forced_output request field"},
          } +
          parallel_flags(),
      run};
  return c;
}

}  // namespace dsv4::cli
