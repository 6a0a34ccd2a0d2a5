// Verify mode: every op of a CUDA forward re-run by the CPU reference op on the CUDA op's own
// inputs (copied to the host right before or after the op), cache writes included. The first op
// that diverges throws a VerifyError naming the block, the op, the element, both values, the
// bound it broke and by how much. Rounding differences cannot compound: each op is judged from
// the GPU's own inputs, never from the CPU's previous result.
//
// Each op is judged element by element against a bound derived from the arithmetic of the kernel
// and of the CPU op (ops/cpu/error_bound.h, where the models are stated), computed on the CPU
// from the same inputs:
//  - GEMMs (FP8 linears on the FP8 tensor-core path or the exact W8A16 path, the cuBLAS BF16
//    linears, wo_a, the head): linear_error_bound with the kernel's sum model (FP8 wgmma: 13
//    fraction bits per k32 step, four steps chained per 128 block in the prefill GEMM, one in
//    the decode stream GEMM; BF16 MMA: 23 bits, the whole K chained), plus half an output ulp
//    of each side; wo_a's inverse RoPE inputs add sum|w| x the width of their rounding interval;
//  - ops with intermediate roundings (hc_pre / hc_head collapse + RMSNorm, q_norm_rope, the
//    indexer's query, weights and logits, the MoE's SwiGLU -> BF16 -> e4m3 intermediate) by
//    interval evaluation: fp32 steps widened by their rounding bounds, each rounding applied to
//    both ends, so an intermediate rounding that may flip on the GPU is allowed exactly there;
//    the MoE's w2 adds sum|w2| x the width of the e4m3 interval of its input;
//  - elementwise fp32 ops on identical inputs (hc_post, SwiGLU, RMSNorm, routing weights, the
//    mHC post / comb weights): 2^-24 per fp32 operation on either side (a first-order bound with
//    the Sinkhorn Jacobian for comb), plus the output roundings;
//  - exact copies (embedding, MTP input sum) bit for bit;
//  - sparse attention by intervals robust to the GPU's key blocking and split-K: scores within
//    the BF16 MMA dot bound, each probability exp(s - m) within its exponent's errors and
//    rounded to BF16 against some running max on either side (2^-9 relative each way), P.V and
//    the denominator summed in fp32, the output rounded to BF16 on both ends;
//  - cache writes (window and compressed KV entries, indexer keys): every element equal or one
//    e4m3 / e2m1 step (or one BF16 ulp for RoPE dims) apart at write time, and over every store
//    >= 99.9 % of the bytes written identical (judged once a store has >= 10000 bytes written);
//    compressor states: relative L2 <= 1e-6 (a copy of fp32 projections plus ape);
//  - indexer top-k: the same sets as the CPU's top-k on the GPU's own scores, except entries
//    whose scores tie with the k-th; MoE router: the same expert sets, except near ties (the
//    GPU-only expert's biased score within 1e-5 relative of the CPU's k-th: the GPU sums the
//    fp32 router logits in another order), the output then judged on the GPU's selection.
// Relative L2 is reported for every op (summary()) but judged only where no per-element bound
// exists (compressor states: a copy, 1e-6).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backends/cpu/weights.h"
#include "backends/cuda/device_cache.h"
#include "core/error.h"
#include "model/model_config.h"
#include "model/op_event.h"
#include "ops/cpu/error_bound.h"
#include "ops/cpu/mhc.h"

namespace dsv4 {

class VerifyError : public Error {
 public:
  explicit VerifyError(const std::string& what) : Error(what) {}
};

struct VerifyTolerances {
  double state_rel_l2 = 1e-6;
  double cache_identical = 0.999;
  int64_t cache_min_bytes = 10000;  // a store's identical fraction is judged from this many bytes
};

// Byte statistics of one cache store kind (window, compressed KV, indexer keys).
struct CacheStoreStats {
  int64_t bytes = 0, identical = 0;
  int64_t elements = 0, elements_one_step = 0, elements_beyond = 0;
  double identical_fraction() const { return bytes ? double(identical) / double(bytes) : 1.0; }
};

struct OpStats {
  int64_t count = 0;
  double worst_rel_l2 = 0;
  double worst_ratio = 0;  // largest |cuda - cpu| / tolerance of an element (<= 1 passes)
};

// An op observer (model/op_event.h): registered with CudaModel::set_verifier, it checks each op
// the model's launcher reports, from the tensors of the event.
class CudaVerifier : public OpObserver {
 public:
  CudaVerifier(const ModelConfig& config, const cpu::ModelWeights& cpu_weights,
               const DeviceCache& cache, cudaStream_t stream, VerifyTolerances tol = {});

  // Check only the ops of blocks first..last (inclusive; last -1: to the last block, MTP blocks
  // after the layers); the others run unchecked (their cache stores too), the embedding and the
  // head are always checked. Throws on a range outside the model's blocks.
  void set_blocks(int first, int last);
  bool checks(int block) const {
    return block < 0 || (block >= first_block_ && block <= last_block_);
  }

  // The FP8 linears run on the exact W8A16 path (--exact-linears) rather than the FP8 tensor
  // cores: their sums are judged by the BF16 MMA model (set by the model it verifies).
  void set_exact_linears(bool exact) { exact_linears_ = exact; }

  // kStepBegin: the step whose ops follow (its chunks give sequences, positions and tokens);
  // kStepEnd judges the cumulative cache statistics (throws on a store below the identical
  // fraction); every op kind is checked after it ran (inputs an op overwrites are read before).
  void before(const OpEvent& e) override;
  void after(const OpEvent& e) override;

  // Host copies of device tensors.
  std::vector<float> bf16(const __nv_bfloat16* p, size_t n) const;
  std::vector<float> f32(const float* p, size_t n) const;
  std::vector<uint8_t> bytes(const void* p, size_t n) const;

  const std::map<std::string, OpStats>& op_stats() const { return ops_; }
  // 0 window, 1 KV, 2 keys.
  const CacheStoreStats& store_stats(int kind) const { return stores_[kind]; }
  int64_t ops_checked() const { return checked_; }
  std::string summary() const;
  // Host seconds spent per op kind so far (also the last line of summary()).
  std::string time_report() const;

 private:
  // One check per op kind (model/op_event.h gives each kind's tensors).
  void begin_step(const OpEvent& e);
  void end_step(const OpEvent& e);
  void embed(const OpEvent& e);
  void hc_pre(const OpEvent& e);
  // hc_pre of block `block`'s attention (ffn = false) or MoE sub-layer with its fused norm, from
  // its input streams on the host (hc_post checks the fused hc_pre from the streams it wrote).
  void hc_pre(int block, bool ffn, const std::vector<float>& streams_in, const __nv_bfloat16* y,
              const float* post, const float* comb);
  void hc_post(const OpEvent& e);
  void linear(const OpEvent& e);
  void rms_norm(const OpEvent& e);
  void q_norm_rope(const OpEvent& e);  // from the input before() read
  // The window entries of the step's tokens from kv (wkv output): packed staged entries
  // [T, 584] when given, else the ring slots they were inserted into (decode).
  void kv_entries(const OpEvent& e);
  // Snapshot of the compressor states of the step's sequences, before the op.
  void before_compressor(int block, bool indexer);
  void compressor(const OpEvent& e);
  void indexer(const OpEvent& e);
  // Sparse attention from q; staged keys read from a staging page (null: every window key
  // from the ring); top-k on CSA layers.
  void attention(const OpEvent& e);
  // wo_a (inverse RoPE + grouped BF16 GEMM) of the o the last attention() check read.
  void wo_a(const OpEvent& e);
  // The ring after the chunk's staged entries went in.
  void window_insert(const OpEvent& e);
  void swiglu(const OpEvent& e);
  void moe(const OpEvent& e);
  // hc_head + final norm (id < 0: the model's head, else MTP block id).
  void hc_head(const OpEvent& e);
  void logits(const OpEvent& e);
  void mtp_combine(const OpEvent& e);

  template <class T>
  std::vector<T> download(const void* p, size_t n) const;  // after the stream's work
  const cpu::BlockWeights& bw(int block) const { return w_.blocks.at(block); }
  // Element by element within `bound` plus the output roundings `r` (cpu::check_bounds).
  void judge(const std::string& op, int block, const std::vector<float>& cuda,
             const std::vector<float>& cpu, const std::vector<float>& bound, cpu::Rounding r,
             const std::vector<int64_t>& shape);
  void compare_exact(const std::string& op, int block, const std::vector<float>& cuda,
                     const std::vector<float>& cpu, const std::vector<int64_t>& shape);
  void compare_rel_l2(const std::string& op, int block, const std::vector<float>& cuda,
                      const std::vector<float>& cpu, const std::vector<int64_t>& shape,
                      double limit);
  // hc_pre's or hc_head's collapse (weights from the mixes, BF16) and RMSNorm on `in` [T, hc,
  // dim] by interval evaluation: the bound of each element of y [T, dim].
  std::vector<float> collapse_norm_bound(const cpu::HcParams& p, const std::vector<float>& in,
                                         const float* norm, const std::vector<float>& want,
                                         int T) const;
  [[noreturn]] void fail(const std::string& op, int block, const std::string& detail) const;
  // Cache entry comparison: `kind` 0 window, 1 compressed KV, 2 indexer keys.
  void compare_entry(const std::string& op, int block, int kind, const uint8_t* cuda_data,
                     const uint8_t* cuda_scales, const uint8_t* cpu_data, const uint8_t* cpu_scales,
                     const std::string& where);
  std::string block_name(int block) const;

  const ModelConfig& c_;
  const cpu::ModelWeights& w_;
  const DeviceCache& cache_;
  cudaStream_t stream_;
  VerifyTolerances tol_;
  bool exact_linears_ = false;
  const std::vector<ChunkRef>* chunks_ = nullptr;
  int tokens_ = 0;
  std::vector<float> q_in_;  // q_norm_rope's input (in place)
  std::vector<int> row0_;    // first row of each chunk
  std::vector<std::vector<float>> state_snap_;
  std::vector<float> last_o_;
  int last_o_block_ = -1;
  std::map<std::string, OpStats> ops_;
  CacheStoreStats stores_[3];
  int64_t checked_ = 0;
  int first_block_ = 0, last_block_ = 1 << 30;
  int64_t route_flips_ = 0;  // MoE rows whose selection differed on a near tie
  // A progress line on stderr every kProgressSeconds: at real geometry one prefill step of
  // verify runs for minutes (the CPU reference at 2048 tokens), silent otherwise.
  static constexpr double kProgressSeconds = 20;
  // Host seconds spent checking each op kind (indexed by OpKind; linears by LinearId in
  // linear_seconds_): where verify's time goes at real geometry, in summary().
  double kind_seconds_[size_t(OpKind::kFfnSublayer) + 1] = {};
  std::map<std::string, double> linear_seconds_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_progress_ = start_;
};

}  // namespace dsv4
