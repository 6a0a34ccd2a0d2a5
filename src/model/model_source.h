// Where a runner's model comes from: a model directory (config.json, hf_quant_config.json,
// safetensors), or random weights generated in memory at load (no file: V4-Flash at full depth
// where the disk has no room for a checkpoint). Both give a Checkpoint, so every loader path
// (the CPU and CUDA backends, the parallel runners' per-rank slicing) runs unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "io/checkpoint.h"
#include "model/model_config.h"
#include "model/quant_scheme.h"

namespace dsv4 {

// The checkpoint `dsv4 make-tiny` would write with the same options, generated in memory.
struct RandomWeights {
  // "flash" or "pro" (the golden sets' geometry), or a config.json's path (its geometry, the
  // flash preset's gains: make-tiny --config). Empty: no random weights.
  std::string preset;
  ExpertFormat format = ExpertFormat::kMxfp4;
  uint64_t seed = 0;
  int layers = 0;  // > 0: the first N layers and no MTP block (make-tiny --layers)
  bool repeat_experts = false;
  int64_t vocab = 0;  // > 0: embedding and head rows (make-tiny --vocab)

  bool enabled() const { return !preset.empty(); }
  // "random weights (flash, nvfp4, seed 1, 3 layers, repeated experts)": the model's name in
  // messages (where a directory's path would stand).
  std::string describe() const;
};

// Exactly one of the two.
struct ModelSource {
  std::string model_dir;
  RandomWeights random;

  // Throws unless exactly one of model_dir and random weights is given.
  void check() const;
  std::string describe() const { return random.enabled() ? random.describe() : model_dir; }
  // Every routed expert of a block is the same bytes (MemoryPlanOptions::repeated_experts).
  bool repeated_experts() const { return random.enabled() && random.repeat_experts; }
};

// What a runner plans with before any weight is read or generated.
struct ModelHeader {
  ModelConfig config;
  QuantScheme scheme;
};
ModelHeader open_model_header(const ModelSource& source);

// The tensors: the directory's safetensors (memory-mapped), or random weights generated now
// (routed experts e > 0 of a block aliasing expert 0's bytes with repeat_experts).
std::unique_ptr<Checkpoint> open_model_checkpoint(const ModelSource& source);

// The bytes random weights hold in memory (the TensorStore's owned bytes), from the config
// alone, nothing generated: every tensor, but with repeat_experts one routed expert per block.
int64_t random_weights_bytes(const RandomWeights& random);

// What nodes of a multi-node run compare to know they load the same model: config.json's
// text, or the random weights' config and options.
std::string model_identity(const ModelSource& source);

}  // namespace dsv4
