// The DeepSeek-V4 forward pass on the GPU, op for op the CPU model's (CpuModel): embedding,
// every block (hc_pre -> RMSNorm -> attention -> hc_post -> hc_pre -> RMSNorm -> MoE ->
// hc_post, with each hc_post fused into the next hc_pre), hc_head -> norm -> head, and the
// MTP block. Cache writes in the CPU model's order: the compressors and the indexer keys
// before attention (a query sees a block that completes at its own position), the chunk's
// window entries after attention (staged until then; a decode step whose sequences bring one
// token each inserts them before attention, which is the same thing for one token).
//
// Everything runs on the context's stream without host synchronisation; the activations are planned
// up front for the largest step (CudaModelLimits) and reused, so a forward can be captured as a
// CUDA graph. Every op runs through one launcher (op()) that hands an OpEvent to the registered
// observers (model/op_event.h): the CudaVerifier re-runs the op on the CPU from its own inputs
// (verify mode), a TraceObserver gives a TraceSink the CPU model's named tensors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

#include "backends/cuda/blas.h"
#include "backends/cuda/device_cache.h"
#include "backends/cuda/device_context.h"
#include "backends/cuda/rank_context.h"
#include "backends/cuda/step.h"
#include "backends/cuda/weights.h"
#include "model/memory_plan.h"
#include "model/model_config.h"
#include "model/op_event.h"
#include "model/trace.h"
#include "model/trace_observer.h"

namespace dsv4 {

class CudaVerifier;
class CudaParallelMoe;

// The largest step the activations are planned for.
struct CudaModelLimits {
  int max_tokens = 1;       // token rows per forward
  int max_seqs = 1;         // sequences per forward
  int64_t max_context = 1;  // positions per sequence (every position < max_context)
  int max_logit_rows = 0;   // logits rows per forward ([rows, vocab] fp32); 0: max_tokens
  // Split-KV scratch of the sparse attention (the memory plan's flat estimate holds it).
  int64_t attn_workspace_bytes = kAttnSplitWorkspaceBytes;
  // FP8 linears on the exact W8A16 path (ops/cuda/gemm/w8a16_linear.h: the reference's exact
  // sums, BF16 tensor-core rate) instead of FP8 tensor cores (faster; ~14-bit sums inside each
  // K block). Plans the BF16 quantised-activation buffers it needs.
  bool exact_linears = false;
  // Decode-sized steps (at most 64 token rows) run the work of a sub-layer that does not depend
  // on its critical path on a second stream of lower priority, joined where its results are
  // read: the compressors' projections and the compressors beside the q path of attention
  // (joined before the indexer), the shared expert beside the routed experts (joined before
  // their combine). Same kernels and buffers either way, so the same bytes; what it saves is
  // the short kernels' latency in series. Never with observers or several ranks.
  bool concurrent_branches = true;
  // Benchmarks: the expert GEMM kernel that steps the heuristic gives the tiled paths (kTiled,
  // kTiledWs) run instead (ops/cuda/moe/moe.h: kTiled or kTiledWs and a token tile; kTiled with
  // tile 0: the heuristic's own). Steps on the stream path (decode sizes) are unaffected; one
  // rank only.
  cuda::moe::MoeGemmPath moe_tiled_path = cuda::moe::MoeGemmPath::kTiled;
  int moe_tiled_tile = 0;
};

// The step metadata's capacities for a model planned with `m`: its token rows and sequences, and
// block-table rows long enough for the planned context (every runner and the benches use it).
StepLimits step_limits(const ModelConfig& mc, const CudaModelLimits& m, const CacheConfig& c);

class CudaModel {
 public:
  // Runs on `ctx` (its stream, cuBLAS handle and device memory), which outlives the model.
  CudaModel(DeviceContext& ctx, const ModelConfig& config, CudaModelWeights weights,
            const CudaModelLimits& limits);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const CudaModelWeights& weights() const { return w_; }
  const CudaModelLimits& limits() const { return limits_; }
  cudaStream_t stream() const { return stream_; }
  DeviceContext& context() const { return ctx_; }
  // Device bytes of the planned activations and workspaces.
  int64_t activation_bytes() const { return act_bytes_; }

  // The parallel engine: this model is one rank's shard (weights uploaded with the rank's
  // cpu::WeightShard) and runs the collectives of `rank` (which outlives the model): the
  // tensor-parallel gathers of the wo_a outputs and indexer heads, the MoE exchanges
  // (backends/cuda/parallel_moe.h). Null: one rank. Not with verify mode or traces.
  void set_rank(const CudaRankContext* rank);
  // A rank whose data-parallel group has no work this step: the MoE collectives of every
  // decoder block with no rows, in forward()'s order.
  void idle_forward();
  // The parallel engine's next steps are decode steps of at most `rows` rows per dp group (the
  // same on every rank): the MoE takes the capturable decode exchange (parallel_moe.h); 0: the
  // host-sized one. At most limits().max_seqs.
  void set_decode_rows(int rows);

  // Observers of every op (synchronise per op; never while capturing a graph): any
  // OpObserver, verify mode (the verifier learns which path the FP8 linears take,
  // --exact-linears, to judge their sums) and traces (a TraceObserver on `t`); null: off.
  void add_observer(OpObserver* o);
  // Whether any observer (verify, a trace) watches the ops: they read tensors on the host
  // at each op, so such steps run eagerly, never as captured graphs.
  bool observed() const { return observer_ != nullptr; }
  void remove_observer(OpObserver* o);
  void set_verifier(CudaVerifier* v);
  void set_trace(TraceSink* t);
  // Benchmarks: CUDA events around every decoder block of each (eager) forward.
  // block_times_ms() after the forward completed: [n_layers] per block (block 0 includes the
  // embedding), then the head (hc_head + norm + logits).
  void set_block_timing(bool on);
  bool block_timing() const { return !events_.empty(); }
  std::vector<float> block_times_ms() const;
  // The events themselves ([n_layers + 2]): a tracer tells their records from any other
  // cudaEventRecord in the forward (a library's own, e.g. inside cuBLAS's split-K GEMMs).
  const std::vector<cudaEvent_t>& block_events() const { return events_; }

  // Embedding, every decoder block, and the logits of st's logit rows: logits() [R, vocab] fp32.
  void forward(const DeviceStep& st, DeviceCache& cache);
  const float* logits() const { return act_.logits; }
  float* logits() { return act_.logits; }  // the runner's sampler patches sampled rows in place
  // The last decoder block's streams of the last forward, [T, hc, dim] BF16 (MTP input).
  const __nv_bfloat16* hidden() const { return act_.streams[cur_]; }

  // MTP block j: from the decoder's last streams at the step's rows and the step's tokens,
  // logits into logits() (predicting two ahead) for the step's logit rows, or for every row
  // [T, vocab] when it names none. hidden() then holds the block's output streams.
  // `logits` false: no head at all (the block's cache writes and output streams only).
  void mtp_forward(int j, const DeviceStep& st, const __nv_bfloat16* main_streams,
                   DeviceCache& cache, bool logits = true);

  // Sub-layers alone, for layer-local tests (device BF16 in/out; rows in chunk order).
  // run_block: streams [T, hc, dim] in place. run_attention: x = attn_norm output [T, dim] ->
  // out [T, dim]. run_moe: x = ffn_norm output -> out. All cache reads and writes included.
  void run_block(int block, const DeviceStep& st, DeviceCache& cache, __nv_bfloat16* streams);
  void run_attention(int block, const DeviceStep& st, DeviceCache& cache, const __nv_bfloat16* x,
                     __nv_bfloat16* out);
  void run_moe(int block, const DeviceStep& st, const __nv_bfloat16* x, __nv_bfloat16* out);
  // hc_head -> norm -> head of `rows` stream rows [rows, hc, dim] into logits().
  void logits_of(const __nv_bfloat16* streams, int rows);

 private:
  struct Fp8Act {
    const uint8_t* codes;
    const float* scales_t;
    int ld;
    int m;
    const __nv_bfloat16* xq;  // exact linears: the quantised activations decoded, [m, k]
    int k;
    const __nv_bfloat16* x;  // the BF16 activations quantised (row stride ldx): observers
    int64_t ldx;
  };

  void plan(const CudaModelLimits& limits);
  void rope_tables(const DeviceStep& st);
  void block_body(int block, const DeviceStep& st, DeviceCache& cache, bool fuse_next);
  void attention(int block, const DeviceStep& st, DeviceCache& cache, const __nv_bfloat16* x,
                 __nv_bfloat16* out);
  void moe(int block, const DeviceStep& st, const __nv_bfloat16* x, __nv_bfloat16* out);
  void hc_pre(int block, bool ffn, const DeviceStep& st, const __nv_bfloat16* streams);
  void hc_post(int block, bool ffn, const DeviceStep& st, const __nv_bfloat16* sub_out,
               int next_block, bool next_ffn);
  void head(const CudaHcUnit& unit, const CudaBf16& norm, const __nv_bfloat16* streams, int rows,
            const int32_t* row_ids, int mtp);

  // FP8 linears: activation quantisation once, then one GEMM per weight, an op observed as
  // linear `id` of `block` (block < 0: not observed by itself).
  // pdl: launch programmatically (false where the op before is not a kernel of ours: a memset
  // or a collective).
  Fp8Act quantize(const __nv_bfloat16* x, int64_t ldx, int m, int k, int slot, bool pdl = true);
  void gemm(const Fp8Act& a, const CudaFp8Linear& w, __nv_bfloat16* y, int64_t ldy, bool pdl,
            int block = -1, LinearId id = LinearId::kWqA);
  // Two weights on the same quantised input in one launch (cuda::fp8_gemm_grouped), one op
  // observed as linears id0 and id1 of `block`. Exact linears: the two GEMMs one after the other.
  struct GemmOut {
    const CudaFp8Linear* w;
    __nv_bfloat16* y;
    int64_t ldy;
    LinearId id;
  };
  // only >= 0: that weight alone, with the bits of the pair's call (Fp8GemmGroupedParams::only).
  void gemm2(const Fp8Act& a, const GemmOut& o0, const GemmOut& o1, int block, int only = -1);
  // The codes and scales a producer kernel quantised into activation slot `slot` (fused
  // quantisation), as quantize() would return them.
  Fp8Act fused_act(const __nv_bfloat16* x, int64_t ldx, int m, int k, int slot) const;
  // A sub-layer's input [m, dim] quantised: the codes the mHC op fused into slot 0 when x is
  // act_.x and they are still there, else quantize(x) into slot 0.
  // pdl false (the op before is not a kernel): always a fresh quantize(x), launched without PDL.
  Fp8Act sublayer_act(const __nv_bfloat16* x, int m, bool pdl);
  // The FP8 quantisation the mHC ops fuse for their output act_.x (none for exact linears or
  // widths not a multiple of 128); sets x_fp8_ accordingly.
  cuda::FusedQuant x_quant(int m);
  int64_t attn_splits_for(int tokens, int heads_per_cta) const;

  // Every tensor-parallel rank's [rows, width] slab (mine) as out [rows, tp x width], rank
  // order (the one-rank column order: heads and groups are split contiguously).
  void tp_gather(const __nv_bfloat16* mine, int rows, int width, __nv_bfloat16* out);

  // The one place ops run: the observers (if any) see `events` before and after `launch`.
  template <class Launch>
  void op(const OpEvent* first, const OpEvent* last, Launch&& launch) {
    if (observer_)
      for (const OpEvent* e = first; e != last; ++e) observer_->before(*e);
    launch();
    if (observer_)
      for (const OpEvent* e = first; e != last; ++e) observer_->after(*e);
  }
  template <class Launch>
  void op(std::initializer_list<OpEvent> events, Launch&& launch) {
    op(events.begin(), events.end(), std::forward<Launch>(launch));
  }
  template <class Launch>
  void op(const OpEvent& event, Launch&& launch) {
    op({event}, std::forward<Launch>(launch));
  }
  void notify(const OpEvent& e) {
    if (observer_) observer_->after(e);
  }
  // The side branches (CudaModelLimits::concurrent_branches): whether a sub-layer of `tokens`
  // rows forks one; fork_side() makes side_ wait for stream_'s work so far, join_side() stream_
  // for side_'s; while an OnSide lives, the launches go to side_.
  bool branches(int tokens) const;
  void fork_side();
  void join_side();
  class OnSide {
   public:
    explicit OnSide(CudaModel& m) : m_(m), saved_(m.stream_) { m.stream_ = m.side_; }
    ~OnSide() { m_.stream_ = saved_; }
    OnSide(const OnSide&) = delete;
    OnSide& operator=(const OnSide&) = delete;

   private:
    CudaModel& m_;
    cudaStream_t saved_;
  };
  void begin_step(const DeviceStep& st);
  void end_step() { notify(OpEvent{OpKind::kStepEnd}); }
  OpEvent linear_event(int block, LinearId id, const __nv_bfloat16* x, int64_t ldx, int m,
                       int64_t in, const void* y, int64_t ldy, int64_t out, bool y_f32) const;

  ModelConfig cfg_;
  CudaModelWeights w_;
  CudaModelLimits limits_;
  DeviceContext& ctx_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_ = nullptr;  // the side branches' stream (lowest priority)
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  // Attention's split q path: the indexer's queries done (main), the compressors done (side).
  cudaEvent_t qi_done_ = nullptr, comp_done_ = nullptr;
  CudaBlas* blas_ = nullptr;
  DeviceBuffer<int32_t> consts_;  // iota [max_tokens], zeros [max_tokens] (the staging page)
  const int32_t* iota_ = nullptr;
  const int32_t* zeros_ = nullptr;
  struct ActPtrs {
    __nv_bfloat16* streams[2];
    float* post[2];
    float* comb[2];
    __nv_bfloat16 *x, *sub_out, *qr, *qr_n, *q, *kv;
    uint8_t *staging, *staged;
    float2* cs[2];  // [T, 32] RoPE angles: plain (ratio 0), YaRN (compressed layers)
    float* comp;    // [T, comp_ld] fp32 compressor projections
    __nv_bfloat16 *qi, *wproj, *q_fp4, *iw, *scores;
    int32_t* topk;
    __nv_bfloat16 *o, *z, *gu, *sact, *shared, *rows, *head_y;
    float* logits;
    __nv_bfloat16 *e, *e_n, *h_n, *ep, *hp;
    __nv_bfloat16* act_xq[2];
    uint8_t* act_codes[2];
    float* act_scales[2];
    void *gemm_ws, *moe_ws, *attn_ws;
    size_t gemm_ws_bytes, moe_ws_bytes, attn_ws_bytes;
    size_t attn_split_bytes;  // of attn_ws: the split-KV budget (attn_splits_for)
  } act_{};
  int64_t comp_ld_ = 0, score_stride_ = 0, act_k_max_ = 0, act_m_max_ = 0;
  int64_t act_bytes_ = 0;
  int cur_ = 0, pp_ = 0;  // current streams buffer, current post/comb buffer
  // Activation slot 0 holds the FP8 codes of act_.x: the mHC op that wrote act_.x quantised it
  // (fused), and nothing has written slot 0 since.
  bool x_fp8_ = false;
  OpObservers observers_;
  OpObserver* observer_ = nullptr;  // &observers_ when any is registered
  CudaVerifier* verifier_ = nullptr;
  std::unique_ptr<TraceObserver> tracer_;
  std::vector<cudaEvent_t> events_;  // block timing: n_layers + 2 events when on
  // Parallel engine (set_rank).
  const CudaRankContext* rank_ = nullptr;
  std::unique_ptr<CudaParallelMoe> pmoe_;
  __nv_bfloat16 *tp_mine_ = nullptr, *tp_all_ = nullptr;  // tp_gather's slabs
};

}  // namespace dsv4
