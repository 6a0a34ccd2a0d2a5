// Pieces shared by the model-running subcommands: their flags and opening the engine.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "args.h"
#include "dsv4/engine.h"

namespace dsv4::cli {

// --model DIR (`model_help` says what the directory holds), --random-weights PRESET and the
// random weights' make-tiny options: --format, --weights-seed (make-tiny's --seed; generate's
// --seed is the sampler's), --layers, --repeat-experts, --vocab.
std::vector<Flag> model_flags(const std::string& model_help);
// The model flags into `o`: exactly one of --model and --random-weights; the make-tiny options
// only with --random-weights; a preset that is neither flash, pro nor a file is refused.
void model_options(const Args& a, EngineOptions& o);

// --backend, --page-size, --cache-mb, --verify, --no-cuda-graphs, --exact-linears, and the
// parallel layout --dp, --ep, --tp.
std::vector<Flag> engine_flags();
// --dp, --ep, --tp (the parallel layout), --comm, and the nodes: --nnodes, --node-rank,
// --master-addr, --master-port.
std::vector<Flag> parallel_flags();
// The parallel flags into `o` (layout, communicator, nodes).
void parallel_options(const Args& a, EngineOptions& o);
// --node-rank > 0: this process is a node following node 0. Runs it (Engine::run_node, the
// CUDA backend registered when built) and returns true when node 0 stops the run; false on
// node 0 (the caller goes on as usual).
bool run_as_follower(const EngineOptions& o);
// --speculative-tokens (generate, serve).
Flag speculative_flag();
// --speculative-rollback rerun|restore (generate, serve).
Flag speculative_rollback_flag();
// Both speculative flags into `o` (--speculative-rollback only with --speculative-tokens > 0).
void speculative_options(const Args& a, EngineOptions& o);
// --prompt-ids, --prompt-file, --prompt, --messages (exactly one is given).
std::vector<Flag> prompt_flags();
// `a` followed by `b`.
std::vector<Flag> operator+(std::vector<Flag> a, const std::vector<Flag>& b);

// The engine options of engine_flags() for one sequence of up to `max_tokens` tokens.
EngineOptions engine_options(const Args& a, int64_t max_tokens);
// Opens --model DIR with engine_options() (registering the CUDA backend when built).
std::unique_ptr<Engine> open_engine(const Args& a, int64_t max_tokens);
std::unique_ptr<Engine> open_engine(const EngineOptions& o);

}  // namespace dsv4::cli
