// Access to ../shared/golden for tests: locating the sets, reading their tensors, and the
// comparison metrics the golden README defines.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "backends/cpu/loader.h"
#include "io/safetensors.h"
#include "model/runner.h"
#include "model/trace.h"

namespace dsv4::test {

// $DSV4_GOLDEN_DIR, else <source>/../shared/golden. Empty if it does not exist.
std::string golden_root();
// Names of the sets present (folders holding golden_logits.safetensors), sorted.
std::vector<std::string> golden_sets();

struct GoldenSet {
  std::string name, dir;
  std::unique_ptr<SafetensorsFile> logits, layers;
  nlohmann::json manifest;
  std::vector<int32_t> master_prompt;
  std::vector<std::vector<int32_t>> batch_prompts;

  explicit GoldenSet(const std::string& name);
  std::string checkpoint(const std::string& fmt = "mxfp4") const;  // "mxfp4" | "nvfp4"
  bool has(const std::string& tensor) const;
  const TensorView& get(const std::string& tensor) const;
};

std::vector<float> to_floats(const TensorView& t);  // BF16 / F32
std::vector<int64_t> to_ints(const TensorView& t);  // I64 / I32

struct Diff {
  double rel_l2 = 0;      // |a-b| / |b|
  double frac_equal = 0;  // bitwise-equal values
  double frac_1ulp = 0;   // within one BF16 ulp of b
  double max_abs = 0;
  size_t n = 0;
};
Diff compare(const float* a, const float* b, size_t n);
inline Diff compare(const std::vector<float>& a, const std::vector<float>& b) {
  return compare(a.data(), b.data(), std::min(a.size(), b.size()));
}
std::string to_string(const Diff& d);

// Per-row logits agreement.
struct LogitStats {
  double min_cos = 1, mean_cos = 0, max_abs = 0, argmax_agree = 0;
  size_t rows = 0;
};
LogitStats logit_stats(const float* a, const float* b, size_t rows, size_t vocab);
std::string to_string(const LogitStats& s);

// The golden README's end-to-end helpers, shared by the CPU and GPU golden tests.
// Top-2 gap of a logits row.
double top2_gap(const float* row, int V);
// Argmax agreement over `rows`, excusing rows where the reference's top-2 gap < near_tie.
double argmax_excusing_ties(const float* ours, const float* ref, size_t rows, int V,
                            double near_tie);
// Rows at `positions` out of full per-position logits [T, V].
std::vector<float> pick(const std::vector<float>& all, const std::vector<int64_t>& positions,
                        int V);
// Greedy continuation check: from our logits at each continuation position, argmax must equal
// the golden token unless the golden's own top-2 gap there is < gap_tol; compares up to the
// first allowed divergence. Returns a failure message or "".
std::string check_greedy(const std::vector<float>& ours, const std::vector<float>& gold_rows,
                         const std::vector<int64_t>& gold_pos, const std::vector<int32_t>& tokens,
                         int prompt_len, int V, double gap_tol);
inline std::vector<int32_t> as_tokens(const std::vector<int64_t>& v) {
  return {v.begin(), v.end()};
}

// Teacher-forced logits of one sequence: `prompt_len` tokens in one step (or in chunks of
// `chunk`), then one token per step. Rows for positions 0..tokens.size()-1.
std::vector<float> forced_logits(Runner& r, const std::vector<int32_t>& tokens, int prompt_len,
                                 int chunk = 0);

// The golden README's end-to-end acceptance of one comparison. Argmax agreement excuses rows
// whose reference top-2 logits are within near_tie (the README's greedy rule): two correct
// implementations that round differently pick either token of a near tie.
struct E2eTolerance {
  double min_cos = 0.999, mean_cos = 0.9999, max_abs = 0.7, argmax = 0.97, near_tie = 0.1;
};

// The per-case end-to-end checks of a golden set (CPU and GPU golden tests); also accumulates
// the raw argmax agreement over the set.
struct E2eChecker {
  E2eTolerance t;
  size_t rows = 0, agree = 0;
  void check(const std::string& what, const float* ours, const float* gold, size_t n, int V);
};

// The sets' batch case: two prompts run together as the reference ran them, one prefill of
// their common prefix, then lockstep one-token steps (each row forced inside its prompt).
struct GoldenBatch {
  std::vector<int64_t> lens;               // prompt lengths
  std::vector<std::vector<int32_t>> rows;  // the tokens of each row, `width` each
  size_t width = 0;
  int common = 0;  // the shorter prompt: one prefill step covers it for both rows
};
GoldenBatch golden_batch(const GoldenSet& g);
// Each row's logits at every position (one sequence per row, each with its own chunk: the rows
// must not affect each other), [width, V] per row.
std::vector<std::vector<float>> batch_logits(Runner& r, const GoldenBatch& b, int V);

// The golden tensor names of layer k: "<prefix>.<what>.L<k>".
inline std::string layer_key(const std::string& prefix, const std::string& what, int k) {
  return prefix + "." + what + ".L" + std::to_string(k);
}
// The stored input of block k in run `prefix` (the previous block's output).
std::vector<float> block_input(const GoldenSet& g, const std::string& prefix, int k);
// Positions (rows of `topk` ids) whose indexer selection equals the reference's, id for id.
int identical_selection_rows(const std::vector<int32_t>& sel, const std::vector<int64_t>& gold,
                             int rows, int topk);

// Keeps every traced tensor, keyed by (block, chunk, name).
class RecordingTrace : public TraceSink {
 public:
  void tensor(int block, int chunk, std::string_view name, const float* data,
              const std::vector<int64_t>& shape) override;
  void ints(int block, int chunk, std::string_view name, const int32_t* data,
            const std::vector<int64_t>& shape) override;
  const std::vector<float>& f(int block, int chunk, const std::string& name) const;
  const std::vector<int32_t>& i(int block, int chunk, const std::string& name) const;
  void clear() {
    floats_.clear();
    ints_.clear();
  }

 private:
  std::map<std::tuple<int, int, std::string>, std::vector<float>> floats_;
  std::map<std::tuple<int, int, std::string>, std::vector<int32_t>> ints_;
};

}  // namespace dsv4::test
