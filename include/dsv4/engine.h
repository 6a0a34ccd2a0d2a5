// The dsv4 engine: open a DeepSeek-V4 model directory and run prompts. This is the whole
// public surface for callers (the CLI, a server): token ids in, logits or token ids out.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/error.h"

namespace dsv4 {

struct EngineOptions {
  std::string model_dir;
  std::string backend = "cpu";  // "cpu" (the reference backend); "cuda" when built
  int page_size = 64;           // entries per cache page
  int max_sequences = 1;        // sequences alive at once
  int64_t max_tokens = 4096;    // per sequence: prompt + generated tokens
  // CUDA backend only.
  bool verify = false;      // re-run every op on the CPU from the GPU's inputs; the first
                            // divergence is thrown as a dsv4::Error naming block, op, metric
  int64_t cache_bytes = 0;  // cache pool size; 0: room for max_sequences x max_tokens
  int max_step_tokens = 0;  // tokens per forward step (longer prefills are chunked); 0: auto
  bool cuda_graphs = true;  // decode steps replayed as CUDA graphs
  // FP8 linears as the reference sums them (W8A16 on BF16 tensor cores: exact products, fp32
  // sums) instead of on FP8 tensor cores (faster; Hopper's FP8 MMA keeps ~14 bits inside each
  // K block, so ~0.7 % of outputs land more than one BF16 ulp from the exact sums).
  bool exact_linears = false;
};

struct SamplingOptions {
  int64_t max_new_tokens = 32;
  float temperature = 0.0f;  // 0 = greedy
  uint64_t seed = 0;
  bool stop_at_eos = true;
};

struct ModelInfo {
  int vocab_size = 0;
  int bos_token_id = 0;
  int eos_token_id = 1;
  int num_layers = 0;
  int num_mtp_layers = 0;
  std::string expert_format;  // "MXFP4" or "NVFP4"
};

class Engine {
 public:
  // Loads and validates the model (config, quantisation scheme, every tensor).
  // Throws dsv4::Error naming what is wrong.
  static std::unique_ptr<Engine> open(const EngineOptions& options);
  // Backends other than the built-in "cpu" register a factory here (the CUDA backend through
  // dsv4::register_cuda_backend(), in the dsv4_cuda library); a later registration of the
  // same name replaces the earlier one.
  using Factory = std::unique_ptr<Engine> (*)(const EngineOptions& options);
  static void register_backend(const std::string& name, Factory factory);
  virtual ~Engine() = default;

  virtual const ModelInfo& info() const = 0;
  // Logits at every position of `prompt` ([prompt.size() * vocab_size], row p predicts token
  // p+1), feeding `chunk` tokens per step (0 = one prefill, 1 = token by token).
  virtual std::vector<float> prompt_logits(const std::vector<int32_t>& prompt, int chunk = 0) = 0;
  // The generated ids (the prompt excluded); stops after EOS when stop_at_eos.
  virtual std::vector<int32_t> generate(const std::vector<int32_t>& prompt,
                                        const SamplingOptions& sampling) = 0;
};

}  // namespace dsv4
