// The CPU backend as a Runner, opened from a model directory (the reference engine: every
// CUDA kernel is tested against it). Opening consults the memory plan first (host memory:
// MemAvailable) and refuses, with the figures, a configuration that cannot fit.
#pragma once

#include <memory>

#include "model/backend_registry.h"

namespace dsv4 {

std::unique_ptr<Runner> open_cpu_runner(const RunnerOptions& options);

}  // namespace dsv4
