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
