// dsv4::Engine on the CUDA backend: the model loaded and repacked once onto the GPU, the
// device memory planned up front (weights, activations for the largest step, the paged cache
// pool from what is left or from EngineOptions::cache_bytes), prompts run through CudaRunner.
// With EngineOptions::verify every op is re-run on the CPU from the GPU's own inputs
// (CudaVerifier) and the first divergence is thrown as a dsv4::Error.
//
// The backend is not part of dsv4_core (which has no CUDA): a program that links dsv4_cuda
// makes it available to Engine::open by calling register_cuda_backend() once.
#pragma once

#include <memory>

#include "dsv4/engine.h"

namespace dsv4 {

// Registers "cuda" with Engine::open (idempotent).
void register_cuda_backend();

std::unique_ptr<Engine> open_cuda_engine(const EngineOptions& options);

}  // namespace dsv4
