// The one memory estimator: what a model takes for a given engine configuration, before
// anything is allocated — weights, the cache pool and the activations of the largest step, for
// each memory the backend uses (the host for the CPU backend; the GPU, and the host when
// verifying, for CUDA). `dsv4 plan` prints it; the backend factories consult it first and
// refuse, with these figures, what cannot fit, instead of failing inside an allocation.
//
// The cache figures are cache_bytes() of plan_cache()'s pool: the bytes the caches allocate
// (CUDA, MTP models: plus the MTP state, device_mtp_state_bytes in model/speculation.h). With
// speculative decoding the CUDA pool also holds speculation's buffers
// (speculation_device_bytes).
// Weights are counted from the weight inventory (weight_inventory()) in each backend's working
// layout; activations are an estimate of the largest buffers of one step.
//
// Several ranks (the parallel engine, model/parallel_layout.h): the CUDA plan holds one pool per
// GPU (rank) with that rank's share of the weights — its routed experts, its tensor-parallel
// share of wq_b, wo_a, the sinks and the indexer's heads, everything else whole — its dp
// group's cache (whole on every rank of the group) and its activations, including the MoE
// exchange's receive buffers; the CPU plan (ranks as threads of one process) sums the ranks
// into the host pool.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/cache_spec.h"
#include "model/backend_registry.h"
#include "model/model_config.h"
#include "model/parallel_layout.h"
#include "model/quant_scheme.h"
#include "model/weights.h"

namespace dsv4 {

enum class PlanBackend { kCpu, kCuda };

// The engine options that decide memory (a subset of RunnerOptions, same meanings).
struct MemoryPlanOptions {
  PlanBackend backend = PlanBackend::kCpu;
  int max_sequences = 1;      // sequences alive at once
  int64_t max_tokens = 4096;  // per sequence
  int page_size = 64;
  int64_t cache_bytes = 0;  // 0: room for max_sequences x max_tokens (CUDA: at most what is left)
  int max_step_tokens = 0;  // 0: the backend's default
  bool verify = false;      // CUDA: the CPU weights on the host as well
  bool exact_linears = false;
  int snapshot_slots = 0;      // prefix-cache snapshot slots beside max_sequences (plan_cache)
  int speculative_tokens = 0;  // > 0: speculation's buffers are counted (RunnerOptions)
  // Every routed expert of a block is the same bytes (random weights with repeated experts):
  // the CPU weights (and the verify mode's) hold one dequantised copy a block.
  bool repeated_experts = false;
  // The parallel layout; max_sequences and the cache are per data-parallel rank.
  ParallelConfig parallel;
};

// The plan's view of the options a backend factory is given.
MemoryPlanOptions memory_plan_options(const RunnerOptions& options, PlanBackend backend);

// Tokens per step when the engine is given none (EngineLoopOptions and the CUDA backend).
constexpr int kDefaultStepTokens = 8192;
// CUDA: the indexer's score rows [step tokens, context / 4] BF16 and the fp32 logits
// [rows, vocab] of a step are kept within these by shortening the step / the logit rows.
constexpr int64_t kCudaScoreBudgetBytes = 1ll << 30;
constexpr int64_t kCudaLogitsBudgetBytes = 1ll << 30;
// CUDA: device memory left free beside the plan (cuBLAS, CUDA graphs, the driver).
constexpr int64_t kCudaReserveBytes = 512ll << 20;
// CPU: host memory for the rest of the process (tokenizer, libraries, the request state).
constexpr int64_t kHostReserveBytes = 256ll << 20;

// Rows per forward step and logits rows per step, as the backend sizes them.
struct StepGeometry {
  int64_t tokens = 0;
  int64_t logit_rows = 0;
};
StepGeometry step_geometry(const ModelConfig& c, const MemoryPlanOptions& o);

// The CUDA sparse attention's predecoded keys for a prefill chunk of `tokens` tokens of one
// sequence at positions below `context` (ops/cuda/sparse_attention, kWgmmaPredecoded): a BF16
// row of 1 KiB for each token, each window slot and each compressed entry it can see (the
// model's finest compression ratio). The CUDA model's attention workspace holds at least this
// much (for head counts the wgmma kernels take), and the memory plan counts it.
int64_t predecoded_keys_bytes(const ModelConfig& c, int64_t tokens, int64_t context);
// The attention workspace's split-KV budget (CudaModelLimits::attn_workspace_bytes' default),
// inside the plan's flat estimate of the kernels' workspaces.
constexpr int64_t kAttnSplitWorkspaceBytes = 64ll << 20;

// One memory (the host, or one GPU).
struct MemoryPool {
  std::string name;          // "host memory", "GPU 0 memory"
  int64_t weights = 0;       // the backend's working copy of the weights
  int64_t cache = 0;         // the cache pool as planned
  int64_t cache_min = 0;     // the smallest pool the engine opens with (see cache_shrinks)
  int64_t activations = 0;   // estimate for the largest step
  int64_t speculation = 0;   // CUDA speculative decoding: rollback area, MTP steps' rows
  int64_t reserve = 0;       // left free for everything else
  std::string weights_note;  // how the weights are held ("fp32 (dequantised)", ...)
  int rank = -1;             // the parallel rank whose memory this is (-1: not parallel)

  int64_t planned() const { return weights + cache + activations + speculation + reserve; }
  int64_t required() const { return weights + cache_min + activations + speculation + reserve; }
};

struct MemoryPlan {
  PlanBackend backend = PlanBackend::kCpu;
  MemoryPlanOptions options;
  StepGeometry step;
  CacheConfig cache;           // the pool plan_cache() gives
  bool cache_shrinks = false;  // CUDA without a cache size: the pool takes what the GPU has
                               // left, at least cache_min (window rings and compressor states)
  std::vector<MemoryPool> pools;
  std::string layout;  // ParallelLayout::describe() with several ranks, else empty
};

// Throws dsv4::Error for options no engine can open (non-positive sizes, too many pages).
// Also for a parallel layout the model does not divide (ParallelLayout's message).
MemoryPlan plan_memory(const ModelConfig& c, const QuantScheme& scheme, const MemoryPlanOptions& o);

// Rank w's share of the weight inventory under `layout` (see above); the whole inventory for
// one rank.
std::vector<ExpectedTensor> rank_weight_inventory(const std::vector<ExpectedTensor>& inventory,
                                                  const ParallelLayout& layout, int w);

// Bytes the host can give this process now: MemAvailable (/proc/meminfo), lowered to the
// cgroup's memory.max headroom when there is one; -1 when unknown.
int64_t host_available_bytes();

// Throws dsv4::Error with the figures when `pool` does not fit in `available` bytes
// (`available_what` says where the figure comes from, e.g. "MemAvailable"). available < 0:
// unknown, nothing is checked.
void require_fits(const MemoryPool& pool, int64_t available, const std::string& available_what);

// "1.5 GiB", "12.0 MiB", "512 B"
std::string human_bytes(int64_t bytes);
// The plan as lines of text (dsv4 plan), one figure a line.
std::string describe_plan(const MemoryPlan& plan);

}  // namespace dsv4
