// Observers at op boundaries: a forward pass runs each op through one launcher, which hands an
// OpEvent (the op, its block, its tensors) to the registered observer before and after the
// op. Verify mode (re-running the op on the CPU from the same inputs) and traces (the CPU
// model's named tensors) are observers; the forward pass does not know who listens. With no
// observer the launcher costs a null check: no synchronisation, nothing copied, so a forward
// can still be captured as a CUDA graph.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "model/step.h"

namespace dsv4 {

enum class OpKind : uint8_t {
  kStepBegin,  // chunks: the step's sequences in row order
  kStepEnd,
  // Ops (tensor order per kind: see the comments).
  kEmbed,         // t0 streams out [T, hc * dim]
  kHcPre,         // id: 1 ffn / 0 attn; t0 streams in, t1 y, t2 post, t3 comb
  kHcPost,        // id: 1 ffn / 0 attn; t0 sub-layer out, t1 res, t2 post, t3 comb, t4 out;
                  // next_block >= 0: the fused hc_pre of (next_block, next_ffn): t5 y, t6 post,
                  // t7 comb
  kLinear,        // id: LinearId; t0 x [m, in], t1 y [m, out]
  kRmsNorm,       // id: NormId; t0 x, t1 y
  kQNormRope,     // t0 q, in place
  kKvEntries,     // t0 kv (wkv output), t1 staged packed entries (null: written to the ring)
  kCompressor,    // id: 1 indexer / 0 main; t0 a projections, t1 g (fp32, row stride ld)
  kIndexer,       // t0 q, t1 weights_proj out, t2 q fp4, t3 weights, t4 scores, t5 top-k
                  // [rows, index_topk] (-1: none); t6 (optional) scores [rows, keys] fp32,
                  // -inf where not visible
  kAttention,     // t0 q, t1 staging page (null: none; rows = its slots), t2 top-k, t3 o
  kWoA,           // t0 z
  kWindowInsert,  // t0 staged packed entries
  kSwiglu,        // t0 gate|up [rows, 2 inter], t1 act [rows, inter]
  kMoe,           // t0 x, t1 shared expert out, t2 selection, t3 weights, t4 y
  kHcHead,        // id: MTP block j, or -1 the model's head; t0 streams, t1 y
  kLogits,        // t0 y, t1 logits
  kMtpCombine,    // t0 e_proj out, t1 h_proj out, t2 streams
  // Sub-layer boundaries (traces): t0 input, t1 output, t2 the block's input streams.
  kAttnSublayer,
  kFfnSublayer,
};

// The linears and norms of a block an event names (verify re-runs the CPU block's weight).
enum class LinearId : uint8_t {
  kWqA,
  kWkv,
  kWqB,
  kWoB,
  kIndexWqB,
  kWeightsProj,
  kCompWkv,
  kCompWgate,
  kIndexCompWkv,
  kIndexCompWgate,
  kSharedW1,
  kSharedW3,
  kSharedW2,
  kEProj,
  kHProj
};
enum class NormId : uint8_t { kQNorm, kEnorm, kHnorm };

// The names reports use (the CPU model's weight names).
inline const char* op_name(LinearId id) {
  static constexpr const char* kNames[] = {"attn.wq_a",
                                           "attn.wkv",
                                           "attn.wq_b",
                                           "attn.wo_b",
                                           "indexer.wq_b",
                                           "indexer.weights_proj",
                                           "compressor.wkv",
                                           "compressor.wgate",
                                           "indexer.compressor.wkv",
                                           "indexer.compressor.wgate",
                                           "shared_expert.w1",
                                           "shared_expert.w3",
                                           "shared_expert.w2",
                                           "mtp.e_proj",
                                           "mtp.h_proj"};
  return kNames[int(id)];
}
inline const char* op_name(NormId id) {
  static constexpr const char* kNames[] = {"attn.q_norm", "mtp.enorm", "mtp.hnorm"};
  return kNames[int(id)];
}

// A [rows, cols] matrix with row stride `ld` elements (ld 0: cols), on the backend's memory.
struct TensorRef {
  const void* data = nullptr;
  DType dtype = DType::kBF16;
  int64_t rows = 0, cols = 0, ld = 0;
  int64_t stride() const { return ld ? ld : cols; }
  template <class T>
  const T* as() const {
    return static_cast<const T*>(data);
  }
};

inline TensorRef bf16_ref(const void* p, int64_t rows, int64_t cols, int64_t ld = 0) {
  return {p, DType::kBF16, rows, cols, ld};
}
inline TensorRef f32_ref(const void* p, int64_t rows, int64_t cols, int64_t ld = 0) {
  return {p, DType::kF32, rows, cols, ld};
}
inline TensorRef i32_ref(const void* p, int64_t rows, int64_t cols) {
  return {p, DType::kI32, rows, cols, 0};
}
inline TensorRef u8_ref(const void* p, int64_t rows, int64_t cols) {
  return {p, DType::kU8, rows, cols, 0};
}

struct OpEvent {
  OpKind kind = OpKind::kStepBegin;
  int block = -1;  // -1: the model (embedding, head)
  int id = 0;      // which instance of the op (LinearId, NormId, ffn, indexer, MTP block)
  std::array<TensorRef, 8> t{};
  int chunk = -1;       // >= 0: the tensors hold this chunk's rows alone, else the step's rows
  int next_block = -1;  // kHcPost: the fused hc_pre's block (-1: none)
  bool next_ffn = false;
  const std::vector<ChunkRef>* chunks = nullptr;  // kStepBegin
  int tokens = 0;                                 // kStepBegin: rows of the step
};

inline OpEvent op_event(OpKind kind, int block, int id, std::initializer_list<TensorRef> tensors) {
  OpEvent e;
  e.kind = kind;
  e.block = block;
  e.id = id;
  DSV4_CHECK(tensors.size() <= e.t.size(), "op event with ", tensors.size(), " tensors, room for ",
             e.t.size());
  std::copy(tensors.begin(), tensors.end(), e.t.begin());
  return e;
}

class OpObserver {
 public:
  virtual ~OpObserver() = default;
  // Before the op runs (for ops that overwrite their inputs); the default ignores it.
  virtual void before(const OpEvent&) {}
  virtual void after(const OpEvent&) = 0;
};

// Several observers in registration order (verify, then traces); itself an observer.
class OpObservers : public OpObserver {
 public:
  void add(OpObserver* o) {
    if (o) list_.push_back(o);
  }
  void remove(OpObserver* o) {
    list_.erase(std::remove(list_.begin(), list_.end(), o), list_.end());
  }
  bool empty() const { return list_.empty(); }
  void before(const OpEvent& e) override {
    for (OpObserver* o : list_) o->before(e);
  }
  void after(const OpEvent& e) override {
    for (OpObserver* o : list_) o->after(e);
  }

 private:
  std::vector<OpObserver*> list_;
};

}  // namespace dsv4
