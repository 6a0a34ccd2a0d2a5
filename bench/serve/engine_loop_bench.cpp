// The engine loop alone, for the server's overhead (bench/serve/overhead.py): N requests of
// --input-len random prompt ids and --output-len tokens (EOS ignored), at most --concurrency
// running, stepped until done on one thread; prints one JSON line with tokens/s.
//
//   engine_loop_bench (--model DIR | --random-weights PRESET [--format F] [--weights-seed S]
//                     [--layers N] [--repeat-experts] [--vocab N]) [--backend cpu|cuda]
//                     [--requests N] [--concurrency C] [--input-len L] [--output-len O]
//                     [--max-model-len M] [--cache-mb MB] [--dp N] [--ep N] [--tp N]
// (the model flags as dsv4's; --concurrency is the whole engine's: with --dp N each
// data-parallel rank runs up to ceil(C / N)).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "dsv4/engine.h"
#if defined(DSV4_WITH_CUDA)
#include "backends/cuda/backend.h"
#endif

namespace {

const char* arg(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return argv[i + 1];
  return fallback;
}

bool has(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == name) return true;
  return false;
}

// An integer flag, the whole text parsed (a typo is an error, not 0).
long long num(int argc, char** argv, const char* name, const char* def) {
  const std::string s = arg(argc, argv, name, def);
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (s.empty() || used != s.size())
    throw std::runtime_error(std::string(name) + ": expected an integer, got '" + s + "'");
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    dsv4::EngineOptions o;
    o.model_dir = arg(argc, argv, "--model", "");
    o.random_weights.preset = arg(argc, argv, "--random-weights", "");
    if (o.model_dir.empty() == o.random_weights.preset.empty()) {
      std::fprintf(stderr,
                   "usage: engine_loop_bench (--model DIR | --random-weights PRESET) [flags] (see "
                   "the source)\n");
      return 2;
    }
    o.random_weights.format = arg(argc, argv, "--format", "mxfp4");
    o.random_weights.seed = uint64_t(num(argc, argv, "--weights-seed", "0"));
    o.random_weights.layers = int(num(argc, argv, "--layers", "0"));
    o.random_weights.repeat_experts = has(argc, argv, "--repeat-experts");
    o.random_weights.vocab = num(argc, argv, "--vocab", "0");
    o.dp = int(num(argc, argv, "--dp", "1"));
    o.ep = int(num(argc, argv, "--ep", "1"));
    o.tp = int(num(argc, argv, "--tp", "1"));
    o.backend = arg(argc, argv, "--backend", "cpu");
    const int requests = int(num(argc, argv, "--requests", "64"));
    const int concurrency = int(num(argc, argv, "--concurrency", "64"));
    const int input_len = int(num(argc, argv, "--input-len", "128"));
    const int output_len = int(num(argc, argv, "--output-len", "32"));
    o.max_sequences = (concurrency + o.dp - 1) / std::max(1, o.dp);  // per data-parallel rank
    o.max_tokens = num(argc, argv, "--max-model-len", "0");
    if (o.max_tokens == 0) o.max_tokens = input_len + output_len;
    o.cache_bytes = num(argc, argv, "--cache-mb", "0") << 20;
#if defined(DSV4_WITH_CUDA)
    dsv4::register_cuda_backend();
#endif
    std::unique_ptr<dsv4::Engine> e = dsv4::Engine::open(o);
    std::mt19937 rng(1);
    std::uniform_int_distribution<int> id(100, e->info().vocab_size - 1);
    dsv4::SamplingOptions s;
    s.max_new_tokens = output_len;
    s.stop_at_eos = false;
    s.temperature = 0.8f;
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < requests; ++r) {
      std::vector<int32_t> prompt(static_cast<size_t>(input_len));
      for (int32_t& t : prompt) t = id(rng);
      s.seed = uint64_t(r);
      e->add_request(prompt, s);
    }
    int64_t generated = 0;
    while (e->has_work())
      for (const dsv4::RequestOutput& out : e->step()) generated += int64_t(out.tokens.size());
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf(
        "{\"bench\": \"engine_loop\", \"requests\": %d, \"concurrency\": %d, \"input_len\": %d, "
        "\"output_len\": %d, \"seconds\": %.3f, \"output_tokens_per_s\": %.2f, "
        "\"total_tokens_per_s\": %.2f}\n",
        requests, concurrency, input_len, output_len, secs, double(generated) / secs,
        double(generated + int64_t(requests) * input_len) / secs);
    return 0;
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "engine_loop_bench: error: %s\n", ex.what());
    return 1;
  }
}
