// Runs batches of sequences through the CPU model: owns the cache (block manager and host
// memory) and the sequences' block tables. One step takes any mix of prefill chunks and
// decode tokens, one contiguous run of tokens per sequence.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "model/cpu_model.h"
#include "runtime/block_manager.h"
#include "runtime/host_cache.h"

namespace dsv4 {

struct StepInput {
  int seq = -1;                 // from open_sequence()
  std::vector<int32_t> tokens;  // appended at the sequence's next positions
  bool all_logits = false;      // logits for every token, else for the last one
};

class CpuRunner {
 public:
  CpuRunner(const CpuModel& model, const CacheConfig& cache);

  // Throws dsv4::Error when no sequence slot or window pages are free.
  int open_sequence();
  void close_sequence(int seq);
  int64_t length(int seq) const;

  // Logits rows in input order: per input, tokens.size() rows if all_logits else 1.
  // Validates token ids and cache room before touching any state; throws dsv4::Error.
  std::vector<float> step(const std::vector<StepInput>& inputs, TraceSink* trace = nullptr,
                          std::vector<float>* hidden_out = nullptr);

  HostCache& cache() { return cache_; }
  SequenceCache& sequence(int seq);
  const CpuModel& model() const { return model_; }

 private:
  const CpuModel& model_;
  BlockManager blocks_;
  HostCache cache_;
  std::map<int, SequenceCache> seqs_;
  int next_id_ = 0;
};

}  // namespace dsv4
