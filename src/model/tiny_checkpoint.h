// Random tiny checkpoints in the official tensor names, dtypes and scale layouts, with the
// geometry of the golden sets tiny-flash / tiny-pro and their conditioning (every residual
// branch adds about 3 % of the stream RMS). For tests and first runs without a real model.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "io/tensor_store.h"
#include "model/model_config.h"
#include "model/quant_scheme.h"

namespace dsv4 {

// "flash" or "pro": the golden sets' geometry. Throws on an unknown preset.
ModelConfig tiny_preset(const std::string& preset);

// The first `layers` main layers of `c` (their compress ratios) without MTP blocks: a model of
// the same shapes with fewer layers. Throws unless 1 <= layers <= c.n_layers.
ModelConfig first_layers(const ModelConfig& c, int layers);

// Weight gains (std = gain / sqrt(fan_in)) that differ between the presets: the pro set
// drives its routed experts into the SwiGLU clamp and scales their outputs down to match.
struct TinyInit {
  double head = 3.0;
  double expert_in = 1.0;         // routed w1 / w3
  double routed_out_coef = 1.58;  // routed w2 gain = rho * coef
  // Every routed expert of a block repeats the first one's random draw: a checkpoint at the
  // real shapes in seconds rather than hours, for benchmarks (the bytes each expert GEMM reads
  // and the routing, which the gate decides, are what a random checkpoint's speed depends on).
  bool repeat_experts = false;
};
TinyInit tiny_init(const std::string& preset);

// Writes config.json, generation_config.json, sharded safetensors with their index and, for
// NVFP4, hf_quant_config.json into `dir` (created if needed). NVFP4 quantises the routed
// experts as ModelOpt does (general E4M3 block scales, fp32 global scale amax/(6*448) shared
// by w1/w3), not as a cast of MXFP4.
void write_tiny_checkpoint(const ModelConfig& config, ExpertFormat format, uint64_t seed,
                           const std::string& dir, const TinyInit& init = TinyInit{});

// The checkpoint write_tiny_checkpoint(config, format, seed, DIR, init) writes, in memory: the
// same tensors, bit for bit; the config and quantisation scheme loading DIR gives. With
// init.repeat_experts the routed experts e > 0 of a block are aliases of expert 0's bytes (the
// store holds the dense weights and one expert per block).
struct TinyModel {
  ModelConfig config;
  QuantScheme scheme;
  std::shared_ptr<const TensorStore> tensors;
};
TinyModel make_tiny_model(const ModelConfig& config, ExpertFormat format, uint64_t seed,
                          const TinyInit& init = TinyInit{});

}  // namespace dsv4
