// Pieces shared by the model-running subcommands.
#pragma once

#include <cstdint>
#include <memory>

#include "args.h"
#include "dsv4/engine.h"

namespace dsv4::cli {

// Opens --model DIR on --backend (default cpu) with room for one sequence of `max_tokens`
// tokens and --page-size (default 64); for --backend cuda also --verify (every op re-run on
// the CPU, the first divergence an error), --cache-mb N (cache pool size), --no-cuda-graphs
// and --exact-linears; --dp, --ep, --tp for the parallel engine (ranks as threads on the CPU
// backend). Commands list these flags among the ones they accept.
std::unique_ptr<Engine> open_engine(const Args& a, int64_t max_tokens);

}  // namespace dsv4::cli
