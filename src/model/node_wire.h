// The multi-node control plane's messages, as bytes (the channel is comm/rendezvous.h; this
// layer only encodes). Node 0 owns the sequences and the pages; each runner operation that
// touches the ranks' caches or runs a step is posted to the other nodes, which apply it to
// their ranks in the same order:
//  - reset a state slot, copy a sequence (fork), copy pages (copy-on-write), stop;
//  - a step: per data-parallel group, its chunks (each sequence's pages, slot and position,
//    the tokens) and the rows whose logits the group's first rank computes.
// What comes back: per group whose first rank is on that node, the logits rows and the rows
// whose hidden state went non-finite; or the error that stopped the node.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/block_manager.h"
#include "model/backend_registry.h"
#include "model/step.h"

namespace dsv4 {

class WireWriter {
 public:
  void u8(uint8_t v) { bytes_.push_back(v); }
  void i64(int64_t v);
  void f64(double v);
  void str(const std::string& s);
  void ints(const std::vector<int>& v);
  void ids(const int32_t* p, size_t n);
  void floats(const std::vector<float>& v);
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  void raw(const void* p, size_t n);
  std::vector<uint8_t> bytes_;
};

// Throws dsv4::Error on a message that ends early.
class WireReader {
 public:
  explicit WireReader(const std::vector<uint8_t>& b) : b_(b) {}
  uint8_t u8();
  int64_t i64();
  double f64();
  std::string str();
  std::vector<int> ints();
  std::vector<int32_t> ids();
  std::vector<float> floats();
  bool done() const { return at_ == b_.size(); }

 private:
  void raw(void* p, size_t n);
  const std::vector<uint8_t>& b_;
  size_t at_ = 0;
};

enum class NodeOp : uint8_t { kStop = 1, kResetStates, kCopySequence, kCopyPages, kStep };

void put_sequence(WireWriter& w, const SequenceCache& s);
SequenceCache get_sequence(WireReader& r);
void put_copies(WireWriter& w, const std::vector<PageCopy>& copies);
std::vector<PageCopy> get_copies(WireReader& r);

// A step's batches as the other nodes run them.
void put_batches(WireWriter& w, const std::vector<StepBatch>& batches);
// The batches (chunks and rows; no sampling) and the storage their chunks point into.
struct ReceivedStep {
  std::deque<SequenceCache> sequences;
  std::deque<std::vector<int32_t>> tokens;
  std::vector<StepBatch> batches;
};
std::unique_ptr<ReceivedStep> get_batches(WireReader& r);

// One data-parallel group's raw results from its first rank: logits [rows, vocab] for the
// batch's `rows`, and per token row the first block whose hidden state went non-finite (-1:
// none; empty when the backend does not tell).
struct GroupResult {
  std::vector<float> logits;
  std::vector<int> nonfinite;
};

// The options a multi-node run's nodes share: node 0's, sent to the others at start (they
// need no prompt to size their caches alike). Everything but the model directory, the node's
// own rank and the rendezvous.
void put_runner_options(WireWriter& w, const RunnerOptions& o);
void get_runner_options(WireReader& r, RunnerOptions& o);

}  // namespace dsv4
