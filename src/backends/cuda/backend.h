// The CUDA backend as a Runner: the model loaded and repacked once onto the GPU, the device
// memory planned up front (weights, activations for the largest step, the paged cache pool
// from what is left or from RunnerOptions::cache_bytes). Opening consults the memory plan
// (model/memory_plan.h) against the GPU's free memory before any upload and refuses, with the
// figures, what cannot fit; every floating-point weight is scanned for NaN/inf first. With
// RunnerOptions::verify every op is re-run on the CPU from the GPU's own inputs (CudaVerifier) and
// the first divergence is thrown as a dsv4::Error.
//
// The backend is not part of the CPU-only libraries: a program that links it makes it
// available to Engine::open by calling register_cuda_backend() once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "model/backend_registry.h"

namespace dsv4 {

// Registers "cuda" (idempotent).
void register_cuda_backend();

std::unique_ptr<Runner> open_cuda_runner(const RunnerOptions& options);

// Free memory of GPU 0 (creating its context), or -1 with `why` saying why there is no usable
// GPU. For `dsv4 plan --backend cuda`.
int64_t cuda_free_device_bytes(std::string* why);

}  // namespace dsv4
