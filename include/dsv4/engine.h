// The dsv4 engine: open a DeepSeek-V4 model directory and run requests. This is the whole
// public surface for callers (the CLI, the server): token ids in, token ids, logprobs or
// logits out. Nothing here exposes a tensor.
//
// Two ways to drive it:
//  - one call per prompt: generate() and prompt_logits();
//  - a serving loop (one thread owns the engine): add_request() any number of requests,
//    call step() while has_work(), each step returning the tokens every request produced;
//    cancel() a request at any time. Requests are batched continuously (prefill chunks mixed
//    into decode steps), admitted by cache capacity, preempted and recomputed when the cache
//    runs out, and a request's output does not depend on what else is in flight.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/error.h"

namespace dsv4 {

// The most drafts speculative decoding verifies per step and sequence.
constexpr int kMaxSpeculativeTokens = 3;

// Random weights instead of a model directory: the checkpoint `dsv4 make-tiny` would write with
// the same options, generated in memory when the engine opens (nothing is written or read;
// V4-Flash at full depth where the disk has no room for a checkpoint). The logits are those of
// the make-tiny checkpoint of the same options, bit for bit.
struct RandomWeightsOptions {
  // "flash" or "pro" (the golden sets' geometry), or a config.json's path (its shapes, e.g.
  // the real V4-Flash's). Empty: no random weights.
  std::string preset;
  std::string format = "mxfp4";  // the routed experts': "mxfp4" or "nvfp4"
  uint64_t seed = 0;             // the weights' seed
  int layers = 0;                // > 0: the first N layers, no MTP block
  // Every routed expert of a layer repeats one random draw, held once in memory (the host then
  // holds the dense weights and one expert per layer).
  bool repeat_experts = false;
  int64_t vocab = 0;  // > 0: embedding and head rows instead of the config's
};

struct EngineOptions {
  // The model: a directory (config.json, *.safetensors) or random weights, exactly one.
  std::string model_dir;
  RandomWeightsOptions random_weights;
  std::string backend = "cpu";  // "cpu" (the reference backend); "cuda" when built
  int page_size = 64;           // entries per cache page
  int max_sequences = 1;        // sequences alive at once (running requests x choices)
  int64_t max_tokens = 4096;    // per sequence: prompt + generated tokens
  int64_t cache_bytes = 0;      // cache pool size; 0: room for max_sequences x max_tokens
  int max_step_tokens = 0;      // tokens per forward step (longer prefills are chunked); 0: auto
  // The prefix cache: resumable snapshots at multiples of `prefix_block` tokens (a hit skips
  // that much prefill; an identical resend of a P-token prompt finds at least P - block
  // tokens when P > 2 block). Each snapshot holds a compressor-state slot and a window ring of
  // its own (V4-Flash: ~15 MB) and shares its compressed pages; -1: max_sequences snapshots,
  // 0: no prefix cache.
  int prefix_snapshots = -1;
  int prefix_block = 256;
  // The parallel engine: attention as dp groups of tp ranks, routed experts over ep ranks, on
  // max(dp x tp, ep) ranks (the CPU backend runs them as threads). With dp > 1,
  // max_sequences, the cache and the prefix cache are per data-parallel rank.
  int dp = 1, ep = 1, tp = 1;
  // CUDA backend with several ranks: the communicator. "nccl": one GPU per rank (threads of
  // this process, NCCL collectives). "inproc": every rank on GPU 0 as threads, collectives by
  // device copies — a test and development facility (parity with one rank without several
  // GPUs), not a way to serve.
  std::string parallel_comm = "nccl";
  // Several nodes, one process each (README: Running on several nodes): the world's ranks
  // split evenly over `nnodes`; node 0 (node_rank 0) is the engine — open() there — and every
  // other node calls Engine::run_node() with the same options but its own node_rank. They meet
  // at master_addr:master_port (node 0 listens there); `node_timeout_s` bounds how long a node
  // waits for the others to join and for their answers after a step (a node that dies is
  // noticed at once; one that stalls after this long).
  int nnodes = 1, node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double node_timeout_s = 120;
  // CUDA backend only.
  bool verify = false;  // re-run every op on the CPU from the GPU's inputs; the first
                        // divergence is thrown as a dsv4::Error naming block, op, metric
  // With verify: check only the ops of blocks verify_first_layer..verify_last_layer (inclusive;
  // -1: to the last, MTP blocks counted after the layers); the others run unchecked, and the
  // embedding and the head are always checked. Splits a verify at real geometry over runs.
  int verify_first_layer = 0, verify_last_layer = -1;
  bool cuda_graphs = true;  // decode steps replayed as CUDA graphs
  // FP8 linears as the reference sums them (W8A16 on BF16 tensor cores: exact products, fp32
  // sums) instead of on FP8 tensor cores (faster; Hopper's FP8 MMA keeps ~14 bits inside each
  // K block, so ~0.7 % of outputs land more than one BF16 ulp from the exact sums).
  bool exact_linears = false;
  // Speculative decoding: the model's MTP block drafts this many tokens (1-3) after each
  // sampled one and the next step verifies them with the target model; the output is plain
  // decoding's, token for token, at any temperature. 0: off.
  int speculative_tokens = 0;
  // How rejected drafts are undone: true (the default), only what the rejected positions changed
  // goes back, no second forward (CPU: the same bytes; CUDA: the kept stores are the verify's,
  // within the end-to-end tolerance; an all-rejected k = 3 step costs what an all-accepted one
  // does, 1.86x a plain step on the H200 where the rerun took 2.85x); false, every store the
  // verify wrote goes back and the kept tokens run again (on CUDA then byte for byte a plain
  // run's stores at zero acceptance).
  bool speculative_restore = true;
};

// How a request's tokens are chosen (the order of the steps: src/ops/common/sampling.h).
struct SamplingOptions {
  int64_t max_new_tokens = 32;
  float temperature = 0.0f;  // 0 = greedy
  uint64_t seed = 0;         // the draw of output token i depends on (seed, i) alone
  bool stop_at_eos = true;
  int top_k = 0;    // 0: off
  float top_p = 1;  // 1: off
  float min_p = 0;  // 0: off
  float presence_penalty = 0;
  float frequency_penalty = 0;
  float repetition_penalty = 1;
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token, bias added to its logit)
  std::vector<int32_t> stop_token_ids;                // finish after emitting any of these
  bool logprobs = false;  // report each chosen token's logprob (raw logits' log-softmax)
  int top_logprobs = 0;   // and this many most likely alternatives (<= 20)
  // >= 0: the logprob of every prompt token after the first (and this many alternatives,
  // <= 20), in the request's first output (OpenAI completions' echo with logprobs).
  int prompt_logprobs = -1;
  // Test facility: emit these ids (through the sampler and the stream) instead of the draws.
  std::vector<int32_t> forced_output;
  // Speculative decoding for this request: -1 the engine's EngineOptions::speculative_tokens,
  // 0 off, else at most this many drafts per step (and at most the engine's; 0..3).
  int speculative_tokens = -1;
  // Test facility: the draft proposed for output index t is forced_drafts[t] (where that
  // exists) instead of the MTP block's; verification and rollback run as usual.
  std::vector<int32_t> forced_drafts;
};

struct ModelInfo {
  int vocab_size = 0;
  int bos_token_id = 0;
  int eos_token_id = 1;
  int num_layers = 0;
  int num_mtp_layers = 0;
  std::string expert_format;  // "MXFP4" or "NVFP4"
  int64_t max_tokens = 0;     // per sequence (prompt + output)
};

enum class FinishReason {
  kNone,    // still running
  kStop,    // EOS or a stop token
  kLength,  // max_new_tokens, or the sequence reached max_tokens
  kAbort,   // cancelled
  kError,   // failed (error says why); the other requests go on
};
const char* finish_reason_name(FinishReason r);  // "stop", "length", "abort", "error"

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
};

// What one step produced for one choice of a request.
struct RequestOutput {
  uint64_t request = 0;
  int choice = 0;                      // 0 .. n-1
  std::vector<int32_t> tokens;         // new tokens since the last output
  std::vector<TokenLogprob> logprobs;  // one per new token when asked
  FinishReason finish = FinishReason::kNone;
  std::string error;
  // With kError: the request itself can never run (larger than the whole cache pool), a
  // client's error rather than the engine's.
  bool unschedulable = false;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens served from the prefix cache
  // When asked (SamplingOptions::prompt_logprobs), in the first output of choice 0: one per
  // prompt token from the second on.
  std::vector<TokenLogprob> prompt_logprobs;
};

// Counters and gauges of the serving loop (the server's /metrics).
struct EngineStats {
  int running = 0, waiting = 0;
  double cache_usage = 0;  // fullest cache store's used fraction, 0..1
  int64_t prompt_tokens = 0, generation_tokens = 0;
  int64_t prefix_queries = 0, prefix_hits = 0;  // tokens looked up / found in the prefix cache
  int64_t preemptions = 0;
  // Speculative decoding (vLLM's spec_decode counters): verify steps, draft tokens verified,
  // drafts accepted, and accepted per draft position (index 0: the first draft).
  int64_t spec_drafts = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0;
  std::vector<int64_t> spec_accepted_per_pos;
};

class Engine {
 public:
  // Loads and validates the model (config, quantisation scheme, every tensor).
  // Throws dsv4::Error naming what is wrong.
  static std::unique_ptr<Engine> open(const EngineOptions& options);
  // Nodes > 0 of a multi-node run: loads this node's ranks (the cache geometry and limits
  // come from node 0, so no prompt is needed here) and runs node 0's steps on them until node 0
  // stops the run (returns) or fails or goes away (throws dsv4::Error).
  static void run_node(const EngineOptions& options);
  virtual ~Engine() = default;

  virtual const ModelInfo& info() const = 0;

  // ---- serving loop ----
  // Queues a request with `n` choices (independent samples sharing the prompt's cache pages);
  // returns its id. Throws dsv4::Error on a request that can never run (empty prompt, id out
  // of range, longer than max_tokens, bad sampling values).
  virtual uint64_t add_request(const std::vector<int32_t>& prompt, const SamplingOptions& sampling,
                               int n = 1) = 0;
  // One engine step: schedule, run the batch, sample. Returns every choice that produced
  // tokens or finished.
  virtual std::vector<RequestOutput> step() = 0;
  // Finishes the request now (kAbort) and frees its cache; unknown or finished ids are ignored.
  virtual void cancel(uint64_t request) = 0;
  virtual bool has_work() const = 0;
  virtual EngineStats stats() const = 0;

  // ---- one call per prompt (wrappers over the loop) ----
  // Logits at every position of `prompt` ([prompt.size() * vocab_size], row p predicts token
  // p+1), feeding `chunk` tokens per step (0 = one prefill, 1 = token by token).
  virtual std::vector<float> prompt_logits(const std::vector<int32_t>& prompt, int chunk = 0) = 0;
  // The generated ids (the prompt excluded); stops after EOS when stop_at_eos.
  virtual std::vector<int32_t> generate(const std::vector<int32_t>& prompt,
                                        const SamplingOptions& sampling) = 0;
};

}  // namespace dsv4
