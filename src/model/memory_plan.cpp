#include "model/memory_plan.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <map>
#include <string_view>

#include "core/error.h"
#include "kvcache/cache_layout.h"
#include "model/cache_spec.h"
#include "model/speculation.h"
#include "model/weights.h"

namespace dsv4 {
namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The CPU backend dequantises every weight exactly to fp32 once (backends/cpu/weights.h);
// scales are folded in, hash-routing tables kept as int32.
int64_t cpu_weight_bytes(const std::vector<ExpectedTensor>& inventory) {
  int64_t bytes = 0;
  for (const ExpectedTensor& t : inventory) {
    const int64_t n = numel(t.shape);
    switch (t.dtype) {
      case DType::kF8E8M0:
        break;  // scales
      case DType::kF8E4M3:
        if (!ends_with(t.name, ".weight_scale")) bytes += 4 * n;  // else NVFP4 block scales
        break;
      case DType::kI8:
      case DType::kU8:
        bytes += 4 * 2 * n;  // two e2m1 values a byte
        break;
      default:
        // BF16, F32 as fp32; tid2eid as int32; NVFP4's global and input scales folded in.
        if (!ends_with(t.name, ".weight_scale_2") && !ends_with(t.name, ".input_scale"))
          bytes += 4 * n;
    }
  }
  return bytes;
}

// The CUDA backend keeps the checkpoint's bytes (backends/cuda/weights.h) plus, per FP8
// linear [n, k], the fp32 transposed scales and the BF16 per-row scales of the exact path.
int64_t cuda_weight_bytes(const std::vector<ExpectedTensor>& inventory) {
  int64_t bytes = 0;
  for (const ExpectedTensor& t : inventory) {
    const int64_t n = numel(t.shape);
    if (t.dtype == DType::kF8E4M3 && ends_with(t.name, ".weight") && t.shape.size() == 2) {
      const int64_t rows = t.shape[0], kb = (t.shape[1] + 127) / 128;
      bytes += n + kb * ((rows + 127) / 128) * 4 + kb * rows * 2;
    } else if (t.dtype == DType::kI64) {
      bytes += 4 * n;  // tid2eid as int32
    } else {
      bytes += n * int64_t(dtype_size(t.dtype));
    }
  }
  return bytes;
}

// The expert index of "….ffn.experts.<e>.…", or -1.
int expert_of(const std::string& name) {
  static const std::string key = ".ffn.experts.";
  const size_t at = name.find(key);
  if (at == std::string::npos) return -1;
  return std::atoi(name.c_str() + at + key.size());
}

// The CPU weights' inventory (one rank's): with repeated experts the routed experts of a block
// are one dequantised copy (cpu::MoeWeights::slot), so only the block's first expert in the
// inventory (expert 0, or a rank's first) is held.
std::vector<ExpectedTensor> cpu_inventory(std::vector<ExpectedTensor> inventory, bool repeated) {
  if (!repeated) return inventory;
  auto block_of = [](const std::string& name) {
    return name.substr(0, name.find(".ffn.experts."));
  };
  std::map<std::string, int> first;
  for (const ExpectedTensor& t : inventory) {
    const int e = expert_of(t.name);
    if (e < 0) continue;
    const auto [it, fresh] = first.emplace(block_of(t.name), e);
    if (!fresh) it->second = std::min(it->second, e);
  }
  inventory.erase(std::remove_if(inventory.begin(), inventory.end(),
                                 [&](const ExpectedTensor& t) {
                                   const int e = expert_of(t.name);
                                   return e >= 0 && e != first.at(block_of(t.name));
                                 }),
                  inventory.end());
  return inventory;
}

// Tensors whose rows are split by heads (or output groups) under tensor parallelism.
bool split_by_heads(const std::string& name) {
  for (const char* part :
       {".attn.wq_b.", ".attn.wo_a.", ".attn.indexer.wq_b.", ".attn.indexer.weights_proj."})
    if (name.find(part) != std::string::npos) return true;
  return ends_with(name, ".attn.attn_sink");
}

// The MoE exchange of an expert-parallel rank: the (token, expert) rows it may receive from
// every dp group's step (each token sends a rank at most min(top-k, its experts) rows) and the
// expert GEMMs' intermediates for them, BF16, dispatch and combine.
int64_t moe_exchange_bytes(const ModelConfig& c, const StepGeometry& s, const ParallelLayout& L) {
  if (L.config().ep == 1) return 0;
  const int64_t rows = int64_t(L.config().dp) * s.tokens *
                       std::min<int64_t>(c.n_activated_experts, L.experts_per_rank());
  return rows * (2 * int64_t(c.dim) + 3 * int64_t(c.moe_inter_dim)) * 2;
}

// The CUDA backend's decode exchange (backends/cuda/parallel_moe.h), for decode steps of up to
// max_sequences rows per dp group: cap = ceil(rows / group size) rows per rank, the rank's slab
// and every EP rank's (routing and BF16 x rows), and the owners' fp32 partial sums sent and
// received. The owner's expert workspace is shared with the exchange above (ep x cap rows of
// min(top-k, experts per rank) slots: within the dp x tokens x min(top-k, experts per rank)
// rows planned there, as ep x cap <= dp x max_sequences).
int64_t cuda_decode_exchange_bytes(const ModelConfig& c, int max_sequences, const StepGeometry& s,
                                   const ParallelLayout& L) {
  const int64_t P = L.config().ep;
  if (P == 1) return 0;
  const int64_t group = L.world() / L.config().dp;
  const int64_t rows = std::min<int64_t>(max_sequences, s.tokens);
  const int64_t cap = (rows + group - 1) / group;
  const int64_t slab = 16 + cap * (8 * int64_t(c.n_activated_experts) + 2 * int64_t(c.dim)) + 288;
  return (P + 1) * slab + 2 * P * cap * int64_t(c.dim) * 4;
}

bool has_ratio(const ModelConfig& c, int r) {
  return std::find(c.compress_ratios.begin(), c.compress_ratios.end(), r) !=
         c.compress_ratios.end();
}

}  // namespace

int64_t predecoded_keys_bytes(const ModelConfig& c, int64_t tokens, int64_t context) {
  const int ratio = has_ratio(c, 4) ? 4 : has_ratio(c, 128) ? 128 : 0;
  const int64_t rows = tokens + c.window_size + (ratio > 0 ? context / ratio : 0);
  return rows * 512 * 2;
}

namespace {

// The CPU forward's largest buffers for a step of T rows (backends/cpu/model.cpp): the hc
// streams, one block's sub-layer inputs and outputs, the attention projections, one chunk's
// gathered keys, the routed experts' rows and the logits of every row.
int64_t cpu_activation_bytes(const ModelConfig& c, const StepGeometry& s, int64_t context) {
  const int64_t T = s.tokens, hc = c.hc_mult, dim = c.dim, H = c.n_heads, D = c.head_dim;
  const int64_t G = c.o_groups, OL = c.o_lora_rank, k = c.n_activated_experts;
  const bool csa = has_ratio(c, 4);
  const int64_t HI = csa ? c.index_n_heads : 0, DI = csa ? c.index_head_dim : 0;
  const int64_t per_row = 2 * hc * dim + 3 * dim + hc + hc * hc + 2 * c.q_lora_rank + 2 * H * D +
                          2 * D + G * OL + OL + c.heads_per_group() * D + HI * DI + HI + 2 * k +
                          k * (dim + 3 * c.moe_inter_dim);
  const int64_t keys = (std::min<int64_t>(c.window_size, context) + context / 4) * D +
                       (csa ? context / 4 * (DI + 1) : 0);
  return 4 * (T * per_row + keys + s.logit_rows * c.vocab_size);
}

int64_t align256(int64_t b) {
  return (std::max<int64_t>(b, 1) + 255) / 256 * 256;
}

// The CUDA model's activation buffers for its step geometry (backends/cuda/model.cpp's
// plan()); the kernels' own workspaces are estimated by kCudaWorkspaceBytes.
constexpr int64_t kCudaWorkspaceBytes = 256ll << 20;
int64_t cuda_activation_bytes(const ModelConfig& c, const StepGeometry& s, int64_t context,
                              bool exact) {
  const int64_t T = s.tokens, R = s.logit_rows, hc = c.hc_mult, dim = c.dim, H = c.n_heads;
  const int64_t D = c.head_dim, G = c.o_groups, OL = c.o_lora_rank, inter = c.moe_inter_dim;
  const bool csa = has_ratio(c, 4), mtp = c.n_mtp_layers > 0;
  const int64_t HI = csa ? c.index_n_heads : 0, DI = csa ? c.index_head_dim : 0;
  const int64_t comp_ld = has_ratio(c, 4) ? 2 * 2 * D + 2 * 2 * DI : has_ratio(c, 128) ? 2 * D : 0;
  const int64_t score_stride = csa ? (context / 4 + 8) / 8 * 8 : 0;
  const int64_t m = mtp ? T * hc : T;
  const int64_t kmax = std::max<int64_t>({dim, c.q_lora_rank, G * OL, inter});
  int64_t b = 0;
  for (int i = 0; i < 2; ++i)
    b += align256(T * hc * dim * 2) + align256(T * hc * 4) + align256(T * hc * hc * 4) +
         align256(T * 32 * 8);
  for (int64_t n : {T * dim, T * dim, T * c.q_lora_rank, T * c.q_lora_rank, T * H * D, T * D,
                    T * HI * DI, T * HI * DI, T * HI, T * HI, T * score_stride, T * H * D,
                    T * G * OL, T * 2 * inter, T * inter, T * dim, R * hc * dim, R * dim})
    b += align256(2 * n);
  b += align256(KvEntryLayout{}.page_bytes(int(std::min<int64_t>(T, 1 << 30)))) +
       align256(T * KvEntryLayout{}.entry_bytes()) + align256(4 * T * comp_ld) +
       align256(4 * T * (csa ? c.index_topk : 0)) + align256(4 * R * c.vocab_size);
  if (mtp) b += 3 * align256(2 * T * dim) + 2 * align256(2 * T * hc * dim);
  for (int i = 0; i < 2; ++i)
    b += align256(exact ? 2 * m * kmax : 0) + align256(m * kmax) + align256(4 * (kmax / 128) * m);
  // The predecoded keys beyond the attention's split budget (inside the flat estimate), where
  // the wgmma kernels run the heads (an over-estimate when tensor parallelism splits them).
  if (c.n_heads % 64 == 0)
    b += std::max<int64_t>(0, predecoded_keys_bytes(c, T, context) - kAttnSplitWorkspaceBytes);
  return b + kCudaWorkspaceBytes;
}

// A pool's bytes bounded from above in double first: far beyond any memory, cache_bytes()'s
// int64 sums must not be reached (they could overflow).
void check_cache_magnitude(const ModelConfig& c, const MemoryPlanOptions& o) {
  const double per_token = double(kv_layout(c).entry_bytes()) + index_layout(c).entry_bytes();
  const double tokens = double(c.window_size) + o.page_size + double(o.max_tokens) / 4 +
                        double(o.max_tokens) / 128 + 2.0 * o.page_size;
  const double state = double(CompressorStateLayout{4, c.head_dim}.bytes()) +
                       double(CompressorStateLayout{128, c.head_dim}.bytes()) +
                       double(CompressorStateLayout{4, index_layout(c).dim}.bytes()) +
                       5.0 * kCacheStoreAlign;
  const double bytes = double(o.max_sequences) * c.num_blocks() * (tokens * per_token + state) * 2;
  DSV4_CHECK(bytes < 1e18, "the cache for ", o.max_sequences, " sequence(s) of ", o.max_tokens,
             " tokens (sliding_window ", c.window_size, ", ", c.num_blocks(),
             " blocks) would take about ", bytes / double(1ll << 40),
             " TiB: more than any machine has");
}

std::string count(int64_t n, const char* what) {
  return cat(n, " ", what, n == 1 ? "" : "s");
}

}  // namespace

std::vector<ExpectedTensor> rank_weight_inventory(const std::vector<ExpectedTensor>& inventory,
                                                  const ParallelLayout& L, int w) {
  std::vector<ExpectedTensor> out;
  const int tp = L.config().tp;
  for (const ExpectedTensor& t : inventory) {
    const int e = expert_of(t.name);
    if (e >= 0 && (e < L.experts_lo(w) || e >= L.experts_lo(w) + L.experts_per_rank())) continue;
    out.push_back(t);
    if (tp > 1 && split_by_heads(t.name) && !t.shape.empty())
      out.back().shape[0] = (t.shape[0] + tp - 1) / tp;
  }
  return out;
}

MemoryPlanOptions memory_plan_options(const RunnerOptions& o, PlanBackend backend) {
  MemoryPlanOptions m;
  m.backend = backend;
  m.max_sequences = o.max_sequences;
  m.max_tokens = o.max_tokens;
  m.page_size = o.page_size;
  m.cache_bytes = o.cache_bytes;
  m.max_step_tokens = o.max_step_tokens;
  m.verify = o.verify;
  m.exact_linears = o.exact_linears;
  m.snapshot_slots = o.snapshot_slots;
  m.speculative_tokens = o.speculative_tokens;
  m.repeated_experts = o.source().repeated_experts();
  m.parallel = {o.dp, o.ep, o.tp};
  return m;
}

StepGeometry step_geometry(const ModelConfig& c, const MemoryPlanOptions& o) {
  StepGeometry s;
  const int64_t all = int64_t(o.max_sequences) * o.max_tokens;
  if (o.backend == PlanBackend::kCpu) {
    s.tokens =
        std::min<int64_t>(o.max_step_tokens > 0 ? o.max_step_tokens : kDefaultStepTokens, all);
    s.logit_rows = s.tokens;  // prompt logits ask for every row
    return s;
  }
  int64_t step = o.max_step_tokens > 0 ? o.max_step_tokens
                                       : std::min<int64_t>(kDefaultStepTokens, o.max_tokens);
  const int64_t score_row = (o.max_tokens / 4 + 8) * 2;
  if (o.max_step_tokens == 0)
    step = std::max<int64_t>(1, std::min(step, kCudaScoreBudgetBytes / score_row));
  s.tokens = std::max<int64_t>(step, o.max_sequences);
  s.logit_rows = std::clamp<int64_t>(kCudaLogitsBudgetBytes / (int64_t(c.vocab_size) * 4),
                                     o.max_sequences, s.tokens);
  return s;
}

MemoryPlan plan_memory(const ModelConfig& c, const QuantScheme& scheme,
                       const MemoryPlanOptions& o) {
  DSV4_CHECK(o.page_size > 0 && o.page_size <= 4096, "page size must be in [1, 4096]");
  DSV4_CHECK(o.max_sequences > 0, "max_sequences must be positive");
  DSV4_CHECK(o.max_tokens > 0, "max_tokens must be positive");
  DSV4_CHECK(o.max_step_tokens >= 0 && o.cache_bytes >= 0, "negative step or cache size");
  check_cache_magnitude(c, o);
  MemoryPlan p;
  p.backend = o.backend;
  p.options = o;
  p.step = step_geometry(c, o);
  p.cache =
      plan_cache(c, o.max_sequences, o.max_tokens, o.page_size, o.cache_bytes, o.snapshot_slots);
  const int64_t cache = cache_bytes(c, p.cache);
  p.cache_shrinks = o.backend == PlanBackend::kCuda && o.cache_bytes == 0;
  const int64_t cache_min =
      p.cache_shrinks
          ? cache_bytes(c, cache_fixed_part(c, o.max_sequences, o.page_size, o.snapshot_slots))
          : cache;
  const std::vector<ExpectedTensor> inventory = weight_inventory(c, scheme);
  const ParallelLayout layout(c, o.parallel);
  const int W = layout.world();
  const int64_t exchange = moe_exchange_bytes(c, p.step, layout);
  if (W > 1) p.layout = layout.describe();

  if (o.backend == PlanBackend::kCpu) {
    // Ranks as threads of this process: every rank's shard, its group's cache and its step.
    MemoryPool host;
    host.name = "host memory";
    for (int w = 0; w < W; ++w)
      host.weights += cpu_weight_bytes(cpu_inventory(
          W == 1 ? inventory : rank_weight_inventory(inventory, layout, w), o.repeated_experts));
    host.weights_note = cat("every weight dequantised to fp32",
                            o.repeated_experts ? " (one routed expert a block)" : "",
                            W == 1 ? "" : cat(", ", W, " ranks' shards"));
    host.cache = host.cache_min = cache * W;
    host.activations = (cpu_activation_bytes(c, p.step, o.max_tokens) + exchange) * W;
    host.reserve = kHostReserveBytes;
    p.pools.push_back(host);
    return p;
  }
  for (int w = 0; w < W; ++w) {
    MemoryPool gpu;
    gpu.name = cat("GPU ", w, " memory");
    gpu.rank = W == 1 ? -1 : w;
    gpu.weights =
        cuda_weight_bytes(W == 1 ? inventory : rank_weight_inventory(inventory, layout, w));
    gpu.weights_note = W == 1 ? "the checkpoint's formats, FP8 scales expanded"
                              : cat("rank ", w, "'s shard: experts ", layout.experts_lo(w), "-",
                                    layout.experts_lo(w) + layout.experts_per_rank() - 1,
                                    layout.config().tp > 1
                                        ? cat(", 1/", layout.config().tp, " of the attention heads")
                                        : std::string(),
                                    "; the checkpoint's formats, FP8 scales expanded");
    // The MTP state beside the stores (DeviceCache: one slot more, the padding rows').
    const int64_t mtp_state = device_mtp_state_bytes(c, p.cache.max_seqs + 1);
    gpu.cache = cache + mtp_state;
    gpu.cache_min = cache_min + mtp_state;
    if (W == 1 && o.speculative_tokens > 0 && c.n_mtp_layers > 0)  // one rank speculates
      gpu.speculation =
          speculation_device_bytes(c, o.max_sequences, p.step.tokens, o.max_tokens, o.page_size);
    gpu.activations = cuda_activation_bytes(c, p.step, o.max_tokens, o.exact_linears) + exchange +
                      cuda_decode_exchange_bytes(c, o.max_sequences, p.step, layout);
    gpu.reserve = kCudaReserveBytes;
    p.pools.push_back(gpu);
  }
  if (o.verify) {
    DSV4_CHECK(W == 1, "verify mode runs one rank");
    MemoryPool host;
    host.name = "host memory";
    host.weights = cpu_weight_bytes(cpu_inventory(inventory, o.repeated_experts));
    host.weights_note = o.repeated_experts
                            ? "verify: the CPU ops' fp32 weights, one routed expert a block"
                            : "verify: the CPU ops' fp32 weights";
    host.reserve = kHostReserveBytes;
    p.pools.push_back(host);
  }
  return p;
}

int64_t host_available_bytes() {
  int64_t avail = -1;
  {
    std::ifstream is("/proc/meminfo");
    std::string key;
    int64_t kb = 0;
    std::string unit;
    while (is >> key >> kb >> unit)
      if (key == "MemAvailable:") {
        avail = kb * 1024;
        break;
      }
  }
  // A cgroup v2 limit (containers): what the group may still take.
  std::ifstream max_is("/sys/fs/cgroup/memory.max"), cur_is("/sys/fs/cgroup/memory.current");
  std::string max_text;
  int64_t current = 0;
  if (max_is >> max_text && max_text != "max" && cur_is >> current) {
    const int64_t headroom = std::max<int64_t>(0, std::stoll(max_text) - current);
    avail = avail < 0 ? headroom : std::min(avail, headroom);
  }
  return avail;
}

std::string human_bytes(int64_t b) {
  char buf[48];
  const double v = double(b);
  if (b >= (1ll << 40))
    std::snprintf(buf, sizeof buf, "%.1f TiB", v / double(1ll << 40));
  else if (b >= (1ll << 30))
    std::snprintf(buf, sizeof buf, "%.1f GiB", v / double(1ll << 30));
  else if (b >= (1ll << 20))
    std::snprintf(buf, sizeof buf, "%.1f MiB", v / double(1ll << 20));
  else if (b >= (1ll << 10))
    std::snprintf(buf, sizeof buf, "%.1f KiB", v / double(1ll << 10));
  else
    std::snprintf(buf, sizeof buf, "%" PRId64 " B", b);
  return buf;
}

void require_fits(const MemoryPool& pool, int64_t available, const std::string& available_what) {
  if (available < 0 || pool.required() <= available) return;
  throw Error(cat("not enough ", pool.name, ": the model needs ", human_bytes(pool.required()),
                  " (weights ", human_bytes(pool.weights), ", cache ", human_bytes(pool.cache_min),
                  ", activations ", human_bytes(pool.activations), ", reserve ",
                  human_bytes(pool.reserve), ") but ", human_bytes(available), " is available (",
                  available_what,
                  "); plan with fewer tokens per sequence, fewer sequences or a smaller cache "
                  "(dsv4 plan)"));
}

std::string describe_plan(const MemoryPlan& p) {
  const MemoryPlanOptions& o = p.options;
  std::string s;
  auto line = [&](const std::string& label, const std::string& text) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%-14s", label.c_str());
    s += cat(buf, text, "\n");
  };
  auto bytes = [](int64_t b) { return cat(b, " bytes (", human_bytes(b), ")"); };
  line("backend", p.backend == PlanBackend::kCpu ? "cpu" : "cuda");
  if (!p.layout.empty()) line("layout", p.layout);
  line("sequences",
       cat(count(o.max_sequences, "sequence"), " of up to ", count(o.max_tokens, "token"),
           ", page size ", o.page_size, p.layout.empty() ? "" : ", per data-parallel rank"));
  line("step", cat(count(p.step.tokens, "token"), ", ", count(p.step.logit_rows, "logits row"),
                   " per forward"));
  line("cache pages",
       cat(p.cache.pages[int(PageKind::kWindow)], " window, ", p.cache.pages[int(PageKind::kC4)],
           " C4, ", p.cache.pages[int(PageKind::kC128)], " C128",
           p.cache_shrinks ? " (shrunk to the GPU memory left)" : ""));
  for (const MemoryPool& m : p.pools) {
    s += m.name + ":\n";
    line("  weights", bytes(m.weights) + (m.weights_note.empty() ? "" : ", " + m.weights_note));
    if (m.cache > 0 || m.cache_min > 0) {
      line("  cache", bytes(m.cache));
      if (m.cache_min != m.cache) line("  cache (min)", bytes(m.cache_min));
    }
    if (m.activations > 0) line("  activations", bytes(m.activations) + ", estimate");
    if (m.speculation > 0)
      line("  speculation", bytes(m.speculation) + ", rollback area and MTP steps' rows");
    line("  reserve", bytes(m.reserve));
    line("  total", bytes(m.cache_min != m.cache ? m.required() : m.planned()));
  }
  return s;
}

}  // namespace dsv4
