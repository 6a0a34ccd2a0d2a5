// Backends by name: each registers a factory that opens a model directory into a Runner. The
// CPU backend is always there (the runtime registers it); the CUDA backend registers itself
// when a program links it and calls register_cuda_backend() (backends/cuda/backend.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/model_source.h"
#include "model/runner.h"

namespace dsv4 {

class Rendezvous;  // comm/rendezvous.h: made by the runtime, opaque here

struct RunnerOptions {
  // The model: a directory, or random weights generated in memory (exactly one).
  std::string model_dir;
  RandomWeights random_weights;
  int page_size = 64;
  int max_sequences = 1;       // sequences alive at once (compressor-state slots)
  int snapshot_slots = 0;      // more slots and window rings, for prefix-cache snapshots
  int64_t max_tokens = 4096;   // per sequence
  int64_t cache_bytes = 0;     // 0: room for max_sequences x max_tokens
  int max_step_tokens = 0;     // 0: the backend's default
  bool verify = false;         // CUDA
  int verify_first_layer = 0;  // CUDA, with verify: the blocks checked (EngineOptions)
  int verify_last_layer = -1;
  bool cuda_graphs = true;     // CUDA
  bool exact_linears = false;  // CUDA
  // MTP drafts per step the engine will ask for (0: no speculation); the memory plan counts
  // speculation's buffers (CUDA: the rollback's save area, the MTP steps' rows) when > 0.
  int speculative_tokens = 0;
  // The parallel engine (model/parallel_layout.h); max_sequences and the cache are then per
  // data-parallel rank.
  int dp = 1, ep = 1, tp = 1;
  // CUDA, several ranks: "nccl" (one GPU per rank, this process) or "inproc" (every rank on
  // GPU 0, collectives by device copies: a test and development facility).
  std::string parallel_comm = "nccl";
  // Several nodes (processes) of one parallel run: the world's ranks split evenly over
  // `nnodes`, this process holding node `node_rank`'s. Node 0 runs the engine; the others
  // follow it (Runner::follow()). `rendezvous`: the connection between the nodes, made by the
  // runtime (Engine::open / Engine::run_node) before the runner; null with one node.
  int nnodes = 1, node_rank = 0;
  std::shared_ptr<Rendezvous> rendezvous;

  ModelSource source() const { return {model_dir, random_weights}; }
};

using RunnerFactory = std::unique_ptr<Runner> (*)(const RunnerOptions& options);

// A later registration of the same name replaces the earlier one.
void register_backend(const std::string& name, RunnerFactory factory);
// Null when no backend of that name is registered.
RunnerFactory find_backend(const std::string& name);
std::vector<std::string> backend_names();

}  // namespace dsv4
