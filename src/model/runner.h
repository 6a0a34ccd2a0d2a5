// The interface both backends implement: sequences in a paged cache and forward steps over a
// mixed batch of prefill chunks and decode tokens. The engine loop (runtime/) drives it; it
// never sees tensors, only token ids in and sampled ids (and, when asked, logits) out.
//
// A sequence holds its cache pages. fork_sequence() makes a sequence at another's length that
// shares its compressed pages (copy-on-write) and owns copies of its window ring and
// compressor states: the prefix cache keeps forks as resumable snapshots, n > 1 forks the
// prompt. Capacity queries never throw, so a scheduler can plan a step that will not fail.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kvcache/block_manager.h"
#include "model/model_config.h"
#include "ops/common/sampling.h"

namespace dsv4 {

// Choose the token after a step input's last token.
struct SampleSpec {
  const SamplingParams* params = nullptr;
  int64_t index = 0;                    // the request's output-token index (the draw's counter)
  const TokenCounts* counts = nullptr;  // penalties' history; null: none
  int32_t forced = -1;                  // >= 0: emit this id instead (test facility)
  // Speculation's test facilities, indexed by output-token index: a verified row j emits
  // (*forced_from)[index + j] where that exists (row 0: `forced` wins), and the draft
  // proposed for output index t is (*draft_override)[t] where that exists, in place of the
  // MTP block's argmax (the block still runs, so its cache and rollback are exercised).
  const std::vector<int32_t>* forced_from = nullptr;
  const std::vector<int32_t>* draft_override = nullptr;
};

// The most draft tokens one step verifies or proposes per sequence (the kernels take up to
// 4 query tokens per sequence: the token sampled last and 3 drafts).
constexpr int kMaxDraftTokens = 3;

// How a verify's rejected drafts are undone (model/speculation.h):
//  kRerun:   every store the step wrote goes back to before it and the kept tokens run again as
//            one chunk. On a backend whose arithmetic depends on the step's shape (CUDA) the
//            stores are then those of a run of the kept tokens alone: at zero acceptance a plain
//            decode step's, byte for byte. Costs a forward of the kept tokens per rejection.
//  kRestore: only the stores the rejected positions changed go back (for_each_rejected_store);
//            the kept positions' stores stay the verify's own. No second forward. On the CPU
//            (arithmetic per token independent of the step's shape) the result is the same
//            bytes as kRerun; on CUDA the kept stores are the (k + 1)-row verify's, which
//            agree with a plain run's within the end-to-end tolerance, not bit for bit.
enum class Rollback { kRerun, kRestore };

struct StepInput {
  StepInput() = default;
  StepInput(int seq_, std::vector<int32_t> tokens_, bool all_logits_ = false)
      : seq(seq_), tokens(std::move(tokens_)), all_logits(all_logits_) {}

  int seq = -1;                 // from open_sequence() / fork_sequence()
  std::vector<int32_t> tokens;  // appended at the sequence's next positions
  bool all_logits = false;      // logits rows for every token, else for the last one
  bool logits = true;           // logits wanted at all (a sampled decode step needs none)
  const SampleSpec* sample = nullptr;
  // Score the tokens that follow: score[j] >= 0 asks for the logprob of that id at row j (the
  // token after tokens[j]) and `score_top` alternatives; empty: none.
  std::vector<int32_t> score;
  int score_top = 0;
  // Speculative decoding (Runner::enable_speculation() first; needs `sample`):
  // `verify` > 0: the last `verify` tokens are drafts. Rows from the one before the first
  // draft on are sampled in order, output index sample->index + j for row j, exactly as plain
  // decoding would sample them, while each sample equals the draft that follows it; the
  // sequence keeps the tokens up to the last accepted draft (every cache store as if only
  // they had run) and the step emits the samples (accepted drafts' successors + the first
  // that differs, or the bonus token after the last draft).
  int verify = 0;
  // `draft` > 0: after the step, the MTP block proposes this many tokens to follow the last
  // emitted one (StepOutput::drafts).
  int draft = 0;
};

struct StepOutput {
  // Rows in input order: per input with `logits`, tokens.size() rows if all_logits else 1;
  // [rows, vocab] fp32.
  std::vector<float> logits;
  // Per input with `sample`, in input order.
  std::vector<SampledToken> samples;
  // Per input with `sample`, in input order: the tokens emitted after samples[i] by a verify
  // (one per accepted draft; empty without), and the drafts proposed for the next step.
  std::vector<std::vector<SampledToken>> more;
  std::vector<std::vector<int32_t>> drafts;
  // Per input with `score`, in input order: one per scored row (id -1 where score[j] < 0).
  std::vector<std::vector<SampledToken>> scores;
  // Per input: empty, or why its results are garbage (non-finite logits or hidden states,
  // naming the position and, where the backend can tell, the first block). Its samples and
  // scores are then id -1; the other inputs are unaffected.
  std::vector<std::string> errors;
};

// Cache occupancy, for schedulers and metrics.
struct CacheUsage {
  int pages_used[kNumPageKinds] = {0, 0, 0};
  int pages_total[kNumPageKinds] = {0, 0, 0};
  int slots_used = 0, slots_total = 0;
  // The fullest paged store's used fraction (0 when none has pages).
  double fraction() const;
};

class Runner {
 public:
  virtual ~Runner() = default;

  virtual const ModelConfig& config() const = 0;
  // The largest step: tokens over all inputs, inputs, and positions per sequence.
  virtual int max_step_tokens() const = 0;
  virtual int max_step_seqs() const = 0;
  virtual int64_t max_context() const = 0;
  virtual int max_logit_rows() const = 0;  // logits rows (wanted or sampled) per step

  // Data parallelism: the parallel engine runs dp_size() groups of ranks, each with its own
  // caches; a sequence lives in one group (forks stay in their source's). One backend: 1.
  virtual int dp_size() const { return 1; }
  virtual int dp_rank(int seq) const = 0;

  // Throw dsv4::Error when the cache has no room (check can_open_on() first).
  virtual int open_sequence_on(int dp_rank) = 0;
  int open_sequence() { return open_sequence_on(0); }
  virtual int fork_sequence(int src) = 0;
  virtual void close_sequence(int seq) = 0;
  virtual int64_t length(int seq) const = 0;

  virtual bool can_open_on(int dp_rank) const = 0;
  bool can_open() const { return can_open_on(0); }
  // Room for `seq` to grow by `n` tokens (copies of shared pages included).
  virtual bool can_append(int seq, int64_t n) const = 0;
  // Pages of kind `k` growing `seq` by `n` tokens takes from its group's pool (new + copies).
  virtual int64_t pages_to_append(int seq, int64_t n, PageKind k) const = 0;
  virtual const CacheSpec& cache_spec() const = 0;
  virtual int page_size() const = 0;
  virtual CacheUsage usage_on(int dp_rank) const = 0;
  // Summed over the groups.
  CacheUsage usage() const;
  // usage() with what only `seqs` hold (their slots, window pages and the pages no other
  // sequence shares) counted as free: the occupancy net of evictable prefix-cache snapshots.
  virtual CacheUsage usage_excluding(const std::vector<int>& seqs) const = 0;
  // Diagnostics worth printing after a run (verify mode's summary); empty when none.
  virtual std::string report() const { return {}; }

  // Speculative decoding: from now on every step keeps the MTP block's cache current (its
  // window over the positions whose next token is known), so that steps may `verify` and
  // `draft`. Throws dsv4::Error when the model has no MTP block or the backend does not
  // implement speculation (it never decodes without it silently).
  virtual void enable_speculation(Rollback /*rollback*/ = Rollback::kRerun) {
    throw Error("this backend does not implement speculative decoding (--speculative-tokens)");
  }
  virtual bool speculation_enabled() const { return false; }

  // Nodes > 0 of a multi-node run (RunnerOptions::node_rank > 0) own no sequences: follow()
  // runs node 0's operations on this node's ranks until node 0 stops the run (returns) or
  // fails or goes away (throws dsv4::Error).
  virtual void follow() { throw Error("this runner is not a node > 0 of a multi-node run"); }
  // Node 0 of a multi-node run: every node has built its runner (the runtime's start check
  // passed). Before it, a runner destroyed on node 0 tells the other nodes nothing (the start
  // check reports the failure to them); after it, it tells them to stop.
  virtual void nodes_started() {}

  // Validates every input (ids, lengths, room) before touching any state; throws dsv4::Error.
  virtual StepOutput step(const std::vector<StepInput>& inputs) = 0;
  // step(inputs).logits.
  std::vector<float> step_logits(const std::vector<StepInput>& inputs) {
    return step(inputs).logits;
  }
  // Hands a step's output back once the caller is done with it: a backend may fill the next
  // step's logits into its storage (no fresh allocation, no page faults on [rows, vocab]
  // fp32 per step). Optional; the default drops it.
  virtual void recycle(StepOutput&& used) { (void)used; }
};

}  // namespace dsv4
