// Opening a model directory (or random weights): config.json, the quantisation scheme, the
// checkpoint's inventory check, the scan for non-finite weights, and the CPU backend's weights.
#pragma once

#include <memory>
#include <string>

#include "backends/cpu/model.h"
#include "model/model_config.h"
#include "model/model_source.h"
#include "model/quant_scheme.h"

namespace dsv4 {

struct LoadedModel {
  ModelConfig config;
  QuantScheme scheme;
  std::unique_ptr<CpuModel> model;
};

// Throws dsv4::Error naming the file, field or tensor at fault.
LoadedModel load_cpu_model(const std::string& dir);
// The same from a directory or random weights.
LoadedModel load_cpu_model(const ModelSource& source);

}  // namespace dsv4
