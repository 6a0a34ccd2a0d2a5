#include "common.h"

#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "core/excerpt.h"
#if defined(DSV4_WITH_CUDA)
#include "backends/cuda/backend.h"
#endif

namespace dsv4::cli {

std::vector<Flag> operator+(std::vector<Flag> a, const std::vector<Flag>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<Flag> parallel_flags() {
  // The parallel engine's layout (README: The parallel engine); ranks run as threads.
  return {
      {"--dp", "N", "data-parallel attention groups", "1", false, {}, 1, 1024},
      {"--ep", "N", "expert-parallel ranks (routed experts split)", "1", false, {}, 1, 1024},
      {"--tp", "N", "tensor-parallel ranks per attention group", "1", false, {}, 1, 1024},
      {"--comm",
       "NAME",
       "cuda, several ranks: nccl (a GPU per rank) or inproc (every rank on GPU 0; tests)",
       "nccl",
       false,
       {"nccl", "inproc"}},
      {"--nnodes",
       "N",
       "nodes (processes) the ranks are spread over, evenly",
       "1",
       false,
       {},
       1,
       1024},
      {"--node-rank",
       "R",
       "this node, 0 = the engine (and the HTTP server); the others follow it",
       "0",
       false,
       {},
       0,
       1023},
      {"--master-addr", "A", "node 0's IPv4 address or host name, where the nodes meet",
       "127.0.0.1"},
      {"--master-port",
       "P",
       "the port node 0 listens on for the other nodes",
       "29500",
       false,
       {},
       1,
       65535},
  };
}

void parallel_options(const Args& a, EngineOptions& o) {
  o.dp = static_cast<int>(a.integer("--dp"));
  o.ep = static_cast<int>(a.integer("--ep"));
  o.tp = static_cast<int>(a.integer("--tp"));
  o.parallel_comm = a.str("--comm");
  o.nnodes = static_cast<int>(a.integer("--nnodes"));
  o.node_rank = static_cast<int>(a.integer("--node-rank"));
  o.master_addr = a.str("--master-addr");
  o.master_port = static_cast<int>(a.integer("--master-port"));
  DSV4_CHECK(o.node_rank < o.nnodes, "--node-rank ", o.node_rank, " must be below --nnodes ",
             o.nnodes);
}

bool run_as_follower(const EngineOptions& o) {
  if (o.node_rank == 0) return false;
#if defined(DSV4_WITH_CUDA)
  register_cuda_backend();
#endif
  std::fprintf(stderr, "dsv4: node %d of %d, following node 0 at %s:%d\n", o.node_rank, o.nnodes,
               o.master_addr.c_str(), o.master_port);
  Engine::run_node(o);
  return true;
}

std::vector<Flag> model_flags(const std::string& model_help) {
  return {
      {"--model", "DIR", model_help},
      {"--random-weights", "PRESET",
       "random weights in memory instead of --model: flash, pro (the golden geometry) or a "
       "config.json (its shapes), as make-tiny would write them"},
      {"--format",
       "FMT",
       "--random-weights: the routed experts' format",
       "mxfp4",
       false,
       {"mxfp4", "nvfp4"}},
      {"--weights-seed", "S", "--random-weights: the weights' seed (make-tiny --seed)", "0"},
      {"--layers",
       "N",
       "--random-weights: the first N layers and no MTP block",
       "",
       false,
       {},
       1,
       1024},
      {"--repeat-experts", "",
       "--random-weights: every routed expert of a layer repeats one draw, held once in memory"},
      {"--vocab",
       "N",
       "--random-weights: embedding and head rows (if not given: the preset's)",
       "",
       false,
       {},
       2,
       1 << 24},
  };
}

void model_options(const Args& a, EngineOptions& o) {
  DSV4_CHECK(a.has("--model") != a.has("--random-weights"),
             "give exactly one of --model and --random-weights");
  if (a.has("--model")) {
    for (const char* f : {"--format", "--weights-seed", "--layers", "--repeat-experts", "--vocab"})
      DSV4_CHECK(!a.has(f), f, " applies to --random-weights (a --model directory has its own)");
    o.model_dir = a.str("--model");
    return;
  }
  RandomWeightsOptions& r = o.random_weights;
  r.preset = a.str("--random-weights");
  DSV4_CHECK(r.preset == "flash" || r.preset == "pro" || std::filesystem::is_regular_file(r.preset),
             "--random-weights: ", excerpt(r.preset),
             " is neither a preset (flash, pro) nor a config.json file");
  r.format = a.str("--format");
  r.seed = a.unsigned_integer("--weights-seed");
  r.layers = a.has("--layers") ? static_cast<int>(a.integer("--layers")) : 0;
  r.repeat_experts = a.has("--repeat-experts");
  r.vocab = a.has("--vocab") ? a.integer("--vocab") : 0;
}

std::vector<Flag> engine_flags() {
  std::vector<Flag> f;
  f.push_back(
      {"--backend", "NAME", "the backend that runs the model", "cpu", false, {"cpu", "cuda"}});
  f.push_back({"--page-size", "P", "cache entries per page", "64", false, {}, 1, 4096});
  f.push_back({"--cache-mb",
               "N",
               "cuda: cache pool size in MiB, 0 = sized from the memory left",
               "0",
               false,
               {},
               0,
               1 << 30});
  f.push_back(
      {"--verify", "", "cuda: re-run every op on the CPU and stop at the first divergence"});
  f.push_back({"--verify-layers", "A-B",
               "with --verify: check only the ops of blocks A..B (or one block A; MTP blocks "
               "after the layers); the rest run unchecked, the embedding and head are checked"});
  f.push_back({"--no-cuda-graphs", "", "cuda: run decode steps eagerly"});
  f.push_back({"--exact-linears", "", "cuda: FP8 linears summed as the reference does (W8A16)"});
  f = f + parallel_flags();
  return f;
}

Flag speculative_flag() {
  return {"--speculative-tokens",
          "K",
          "MTP speculative decoding: drafts verified per step, 0 = off",
          "0",
          false,
          {},
          0,
          kMaxSpeculativeTokens};
}

Flag speculative_rollback_flag() {
  return {"--speculative-rollback",
          "HOW",
          "rejected drafts undone by rerunning the kept tokens (rerun) or by restoring only the "
          "rejected positions' stores (restore: no second forward)",
          "restore",
          false,
          {"rerun", "restore"}};
}

void speculative_options(const Args& a, EngineOptions& o) {
  o.speculative_tokens = static_cast<int>(a.integer("--speculative-tokens"));
  o.speculative_restore = a.str("--speculative-rollback") == "restore";
  DSV4_CHECK(!a.has("--speculative-rollback") || o.speculative_tokens > 0,
             "--speculative-rollback applies with --speculative-tokens above 0");
}

std::vector<Flag> prompt_flags() {
  return {
      {"--prompt-ids", "IDS",
       "the prompt's token ids, comma-separated (\"0,17,42\" or \"0, 17, 42\")"},
      {"--prompt-file", "FILE", "a file of token ids: comma-separated, on one or more lines"},
      {"--prompt", "TEXT", "the prompt as text, tokenized with the model's tokenizer.json"},
      {"--messages", "FILE", "a JSON chat (as for render), rendered and tokenized"},
  };
}

EngineOptions engine_options(const Args& a, int64_t max_tokens) {
  EngineOptions o;
  model_options(a, o);
  o.backend = a.str("--backend");
  o.page_size = static_cast<int>(a.integer("--page-size"));
  o.max_sequences = 1;
  o.max_tokens = std::max<int64_t>(max_tokens, 1);
  o.verify = a.has("--verify");
  if (a.has("--verify-layers")) {
    DSV4_CHECK(o.verify, "--verify-layers applies to --verify");
    const std::string v = a.str("--verify-layers");
    const size_t dash = v.find('-');
    const auto number = [&](const std::string& s) {
      DSV4_CHECK(
          !s.empty() && s.size() <= 6 && s.find_first_not_of("0123456789") == std::string::npos,
          "--verify-layers: '", v, "' is not A-B or A (block numbers from 0)");
      return std::stoi(s);
    };
    o.verify_first_layer = number(v.substr(0, dash));
    o.verify_last_layer =
        dash == std::string::npos ? o.verify_first_layer : number(v.substr(dash + 1));
    DSV4_CHECK(o.verify_first_layer <= o.verify_last_layer, "--verify-layers: ", v,
               " ends before it starts");
  }
  o.cuda_graphs = !a.has("--no-cuda-graphs");
  o.exact_linears = a.has("--exact-linears");
  parallel_options(a, o);
  const int64_t cache_mb = a.integer("--cache-mb");
  o.cache_bytes = cache_mb << 20;
  if (o.backend != "cuda")
    DSV4_CHECK(
        !o.verify && cache_mb == 0 && o.cuda_graphs && !o.exact_linears,
        "--verify, --cache-mb, --no-cuda-graphs and --exact-linears apply to --backend cuda");
  return o;
}

std::unique_ptr<Engine> open_engine(const Args& a, int64_t max_tokens) {
  return open_engine(engine_options(a, max_tokens));
}

std::unique_ptr<Engine> open_engine(const EngineOptions& o) {
#if defined(DSV4_WITH_CUDA)
  register_cuda_backend();
#endif
  return Engine::open(o);
}

}  // namespace dsv4::cli
