#include "support/golden.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/formats.h"
#include "ops/cpu/dequant.h"

namespace fs = std::filesystem;

namespace dsv4::test {

std::string golden_root() {
  std::string dir;
  if (const char* env = std::getenv("DSV4_GOLDEN_DIR"); env && *env)
    dir = env;
  else
    dir = std::string(DSV4_SOURCE_DIR) + "/../shared/golden";
  return fs::is_directory(dir) ? fs::canonical(dir).string() : std::string();
}

std::vector<std::string> golden_sets() {
  std::vector<std::string> v;
  const std::string root = golden_root();
  if (root.empty()) return v;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && fs::exists(e.path() / "golden_logits.safetensors"))
      v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

GoldenSet::GoldenSet(const std::string& n) : name(n), dir(golden_root() + "/" + n) {
  logits = std::make_unique<SafetensorsFile>(dir + "/golden_logits.safetensors");
  layers = std::make_unique<SafetensorsFile>(dir + "/golden_layers.safetensors");
  std::ifstream is(dir + "/manifest.json");
  manifest = nlohmann::json::parse(is);
  for (const auto& v : manifest["cases"]["master_prompt"])
    master_prompt.push_back(v.get<int32_t>());
  for (const auto& p : manifest["cases"]["batch_prompts"]) {
    batch_prompts.emplace_back();
    for (const auto& v : p) batch_prompts.back().push_back(v.get<int32_t>());
  }
}

std::string GoldenSet::checkpoint(const std::string& fmt) const {
  return dir + "/hf-" + fmt;
}

bool GoldenSet::has(const std::string& t) const {
  return logits->contains(t) || layers->contains(t);
}

const TensorView& GoldenSet::get(const std::string& t) const {
  if (logits->contains(t)) return logits->get(t);
  return layers->get(t);
}

std::vector<float> to_floats(const TensorView& t) {
  return cpu::to_float(t);
}

std::vector<int64_t> to_ints(const TensorView& t) {
  std::vector<int64_t> v(size_t(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t.dtype == DType::kI64)
      std::memcpy(&v[i], t.data + 8 * i, 8);
    else if (t.dtype == DType::kI32) {
      int32_t x;
      std::memcpy(&x, t.data + 4 * i, 4);
      v[i] = x;
    } else {
      throw Error(cat("to_ints: ", t.name, " is ", dtype_name(t.dtype)));
    }
  }
  return v;
}

Diff compare(const float* a, const float* b, size_t n) {
  Diff d;
  d.n = n;
  double num = 0, den = 0;
  size_t eq = 0, ulp = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = a[i], y = b[i];
    if (std::isinf(x) && std::isinf(y) && (x > 0) == (y > 0)) {
      ++eq, ++ulp;
      continue;
    }
    num += (x - y) * (x - y);
    den += y * y;
    d.max_abs = std::max(d.max_abs, std::fabs(x - y));
    if (a[i] == b[i]) ++eq;
    // One BF16 ulp of the reference value (2^(e-7) for |b| in [2^e, 2^(e+1))).
    int e;
    std::frexp(y == 0 ? 1e-30 : y, &e);
    const double u = std::ldexp(1.0, e - 8);
    if (std::fabs(x - y) <= u * 1.0000001) ++ulp;
  }
  d.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  d.frac_equal = n ? double(eq) / n : 1;
  d.frac_1ulp = n ? double(ulp) / n : 1;
  return d;
}

std::string to_string(const Diff& d) {
  std::ostringstream os;
  os << "relL2 " << d.rel_l2 << ", equal " << d.frac_equal * 100 << "%, within 1ulp "
     << d.frac_1ulp * 100 << "%, max|d| " << d.max_abs << " (n " << d.n << ")";
  return os.str();
}

LogitStats logit_stats(const float* a, const float* b, size_t rows, size_t V) {
  LogitStats s;
  s.rows = rows;
  size_t agree = 0;
  double sum_cos = 0;
  for (size_t r = 0; r < rows; ++r) {
    const float* x = a + r * V;
    const float* y = b + r * V;
    double xy = 0, xx = 0, yy = 0;
    size_t ax = 0, ay = 0;
    for (size_t i = 0; i < V; ++i) {
      xy += double(x[i]) * y[i];
      xx += double(x[i]) * x[i];
      yy += double(y[i]) * y[i];
      s.max_abs = std::max(s.max_abs, std::fabs(double(x[i]) - y[i]));
      if (x[i] > x[ax]) ax = i;
      if (y[i] > y[ay]) ay = i;
    }
    const double c = xy / std::sqrt(xx * yy);
    s.min_cos = std::min(s.min_cos, c);
    sum_cos += c;
    agree += (ax == ay);
  }
  s.mean_cos = rows ? sum_cos / rows : 1;
  s.argmax_agree = rows ? double(agree) / rows : 1;
  return s;
}

std::string to_string(const LogitStats& s) {
  std::ostringstream os;
  os.precision(7);
  os << "rows " << s.rows << ", min cos " << s.min_cos << ", mean cos " << s.mean_cos << ", max|d| "
     << s.max_abs << ", argmax " << s.argmax_agree * 100 << "%";
  return os.str();
}

void RecordingTrace::tensor(int block, int chunk, std::string_view name, const float* data,
                            const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  floats_[{block, chunk, std::string(name)}].assign(data, data + n);
}

void RecordingTrace::ints(int block, int chunk, std::string_view name, const int32_t* data,
                          const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  ints_[{block, chunk, std::string(name)}].assign(data, data + n);
}

const std::vector<float>& RecordingTrace::f(int block, int chunk, const std::string& name) const {
  auto it = floats_.find({block, chunk, name});
  DSV4_CHECK(it != floats_.end(), "trace has no ", name, " of block ", block);
  return it->second;
}

const std::vector<int32_t>& RecordingTrace::i(int block, int chunk, const std::string& name) const {
  auto it = ints_.find({block, chunk, name});
  DSV4_CHECK(it != ints_.end(), "trace has no ", name, " of block ", block);
  return it->second;
}

double top2_gap(const float* row, int V) {
  std::vector<float> s(row, row + V);
  std::partial_sort(s.begin(), s.begin() + 2, s.end(), std::greater<float>());
  return double(s[0]) - s[1];
}

double argmax_excusing_ties(const float* ours, const float* ref, size_t rows, int V,
                            double near_tie) {
  size_t ok = 0;
  for (size_t r = 0; r < rows; ++r) {
    const float* a = ours + r * V;
    const float* b = ref + r * V;
    const bool same = std::max_element(a, a + V) - a == std::max_element(b, b + V) - b;
    ok += same || top2_gap(b, V) < near_tie;
  }
  return rows ? double(ok) / rows : 1.0;
}

std::vector<float> pick(const std::vector<float>& all, const std::vector<int64_t>& positions,
                        int V) {
  std::vector<float> out;
  for (int64_t p : positions) out.insert(out.end(), all.begin() + p * V, all.begin() + (p + 1) * V);
  return out;
}

std::string check_greedy(const std::vector<float>& ours, const std::vector<float>& gold_rows,
                         const std::vector<int64_t>& gold_pos, const std::vector<int32_t>& tokens,
                         int prompt_len, int V, double gap_tol) {
  for (size_t p = prompt_len - 1; p + 1 < tokens.size(); ++p) {
    const float* row = ours.data() + p * V;
    const int32_t mine = static_cast<int32_t>(std::max_element(row, row + V) - row);
    if (mine == tokens[p + 1]) continue;
    auto it = std::find(gold_pos.begin(), gold_pos.end(), int64_t(p));
    if (it == gold_pos.end()) return "";  // no reference logits there: cannot judge further
    const double gap = top2_gap(gold_rows.data() + (it - gold_pos.begin()) * V, V);
    if (gap < gap_tol) return "";  // a near tie: the sequences may part here
    return cat("greedy token at position ", p + 1, ": ours ", mine, ", reference ", tokens[p + 1],
               " (reference top-2 gap ", gap, ")");
  }
  return "";
}

std::vector<float> forced_logits(Runner& r, const std::vector<int32_t>& tokens, int prompt_len,
                                 int chunk) {
  const int seq = r.open_sequence();
  std::vector<float> all;
  const int step = chunk > 0 ? chunk : prompt_len;
  for (int i = 0; i < prompt_len; i += step) {
    const int n = std::min(step, prompt_len - i);
    std::vector<float> l =
        r.step_logits({{seq, {tokens.begin() + i, tokens.begin() + i + n}, true}});
    all.insert(all.end(), l.begin(), l.end());
  }
  for (size_t p = prompt_len; p < tokens.size(); ++p) {
    std::vector<float> row = r.step_logits({{seq, {tokens[p]}, false}});
    all.insert(all.end(), row.begin(), row.end());
  }
  r.close_sequence(seq);
  return all;
}

void E2eChecker::check(const std::string& what, const float* ours, const float* gold, size_t n,
                       int V) {
  const LogitStats s = logit_stats(ours, gold, n, V);
  const double excused = argmax_excusing_ties(ours, gold, n, V, t.near_tie);
  std::printf("    %-28s %s; argmax excusing near ties %.2f%%\n", what.c_str(),
              to_string(s).c_str(), 100 * excused);
  EXPECT_GE(s.min_cos, t.min_cos) << what;
  EXPECT_GE(s.mean_cos, t.mean_cos) << what;
  EXPECT_LE(s.max_abs, t.max_abs) << what;
  EXPECT_GE(excused, t.argmax) << what;
  rows += n;
  agree += static_cast<size_t>(std::llround(s.argmax_agree * n));
}

GoldenBatch golden_batch(const GoldenSet& g) {
  GoldenBatch b;
  b.lens = to_ints(g.get("batch.prompt_lens"));
  const std::vector<int64_t> bt = to_ints(g.get("batch.prefill.tokens"));
  b.width = bt.size() / 2;
  b.rows.resize(2);
  for (int r = 0; r < 2; ++r)
    b.rows[r].assign(bt.begin() + r * b.width, bt.begin() + (r + 1) * b.width);
  b.common = static_cast<int>(std::min(b.lens[0], b.lens[1]));
  return b;
}

std::vector<std::vector<float>> batch_logits(Runner& r, const GoldenBatch& b, int V) {
  const int s0 = r.open_sequence(), s1 = r.open_sequence();
  std::vector<std::vector<float>> out(2);
  {
    std::vector<float> l =
        r.step_logits({{s0, {b.rows[0].begin(), b.rows[0].begin() + b.common}, true},
                       {s1, {b.rows[1].begin(), b.rows[1].begin() + b.common}, true}});
    out[0].assign(l.begin(), l.begin() + size_t(b.common) * V);
    out[1].assign(l.begin() + size_t(b.common) * V, l.end());
  }
  for (size_t p = b.common; p < b.width; ++p) {
    std::vector<float> l =
        r.step_logits({{s0, {b.rows[0][p]}, false}, {s1, {b.rows[1][p]}, false}});
    out[0].insert(out[0].end(), l.begin(), l.begin() + V);
    out[1].insert(out[1].end(), l.begin() + V, l.end());
  }
  r.close_sequence(s0);
  r.close_sequence(s1);
  return out;
}

std::vector<float> block_input(const GoldenSet& g, const std::string& prefix, int k) {
  return to_floats(
      g.get(k == 0 ? layer_key(prefix, "hidden.in", 0) : layer_key(prefix, "hidden.out", k - 1)));
}

int identical_selection_rows(const std::vector<int32_t>& sel, const std::vector<int64_t>& gold,
                             int rows, int topk) {
  int same_rows = 0;
  for (int t = 0; t < rows; ++t) {
    bool same = true;
    for (int j = 0; j < topk; ++j) same &= sel[size_t(t) * topk + j] == gold[size_t(t) * topk + j];
    same_rows += same;
  }
  return same_rows;
}

}  // namespace dsv4::test
