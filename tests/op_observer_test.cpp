// Op observers (model/op_event.h): the trace observer both backends use turns op events into
// the CPU model's named per-chunk tensors (values, shapes, strided rows, BF16, per-chunk
// events, the top-k rows sorted as the CPU traces them), and the observer list calls its
// observers in order and can drop one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/formats.h"
#include "model/op_event.h"
#include "model/trace_observer.h"

namespace dsv4 {
namespace {

struct Recorded {
  std::vector<float> f;
  std::vector<int32_t> i;
  std::vector<int64_t> shape;
};

class Sink : public TraceSink {
 public:
  void tensor(int block, int chunk, std::string_view name, const float* data,
              const std::vector<int64_t>& shape) override {
    Recorded& r = at(block, chunk, name);
    r.f.assign(data, data + count(shape));
    r.shape = shape;
  }
  void ints(int block, int chunk, std::string_view name, const int32_t* data,
            const std::vector<int64_t>& shape) override {
    Recorded& r = at(block, chunk, name);
    r.i.assign(data, data + count(shape));
    r.shape = shape;
  }
  bool has(int block, int chunk, const std::string& name) const {
    return got.count({block, chunk, name}) > 0;
  }
  const Recorded& get(int block, int chunk, const std::string& name) const {
    return got.at({block, chunk, name});
  }
  std::map<std::tuple<int, int, std::string>, Recorded> got;

 private:
  static int64_t count(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  Recorded& at(int block, int chunk, std::string_view name) {
    return got[{block, chunk, std::string(name)}];
  }
};

TraceObserver host_tracer(Sink& sink, int hc, int dim) {
  return TraceObserver(
      sink, [](void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }, hc,
      dim);
}

std::vector<ChunkRef> two_chunks() {
  return {{nullptr, 0, nullptr, 2}, {nullptr, 7, nullptr, 3}};
}

OpEvent step_begin(const std::vector<ChunkRef>& chunks) {
  OpEvent e{OpKind::kStepBegin};
  e.chunks = &chunks;
  for (const ChunkRef& c : chunks) e.tokens += c.n;
  return e;
}

TEST(TraceObserver, SublayerRowsPerChunkWithShapes) {
  const int hc = 2, dim = 3, T = 5;
  Sink sink;
  TraceObserver tr = host_tracer(sink, hc, dim);
  const std::vector<ChunkRef> chunks = two_chunks();
  tr.after(step_begin(chunks));
  std::vector<float> x(T * dim), y(T * dim), s(T * hc * dim);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i), y[i] = -float(i);
  for (size_t i = 0; i < s.size(); ++i) s[i] = 0.5f * float(i);
  tr.after(op_event(
      OpKind::kAttnSublayer, 4, 0,
      {f32_ref(x.data(), T, dim), f32_ref(y.data(), T, dim), f32_ref(s.data(), T, hc * dim)}));
  const Recorded& in1 = sink.get(4, 1, "attn_in");
  EXPECT_EQ(in1.shape, (std::vector<int64_t>{3, dim}));
  EXPECT_EQ(in1.f, std::vector<float>(x.begin() + 2 * dim, x.end()));
  EXPECT_EQ(sink.get(4, 0, "attn_out").f, std::vector<float>(y.begin(), y.begin() + 2 * dim));
  const Recorded& h0 = sink.get(4, 0, "hidden.in");
  EXPECT_EQ(h0.shape, (std::vector<int64_t>{2, hc, dim}));
  EXPECT_EQ(h0.f, std::vector<float>(s.begin(), s.begin() + 2 * hc * dim));
  // hidden.out from the MoE's hc_post only (id 1), not the attention's.
  tr.after(op_event(OpKind::kHcPost, 4, 0, {{}, {}, {}, {}, f32_ref(s.data(), T, hc * dim)}));
  EXPECT_FALSE(sink.has(4, 0, "hidden.out"));
  tr.after(op_event(OpKind::kHcPost, 4, 1, {{}, {}, {}, {}, f32_ref(s.data(), T, hc * dim)}));
  EXPECT_EQ(sink.get(4, 1, "hidden.out").shape, (std::vector<int64_t>{3, hc, dim}));
  // Events the trace does not name record nothing.
  const size_t n = sink.got.size();
  tr.after(op_event(OpKind::kLinear, 4, int(LinearId::kWqA),
                    {f32_ref(x.data(), T, dim), f32_ref(y.data(), T, dim)}));
  EXPECT_EQ(sink.got.size(), n);
}

TEST(TraceObserver, StridedBf16RowsAndRouting) {
  const int T = 5, w = 2, ld = 4, K = 2;
  Sink sink;
  TraceObserver tr = host_tracer(sink, 2, 3);
  const std::vector<ChunkRef> chunks = two_chunks();
  tr.after(step_begin(chunks));
  std::vector<uint16_t> x(T * ld, float_to_bf16(99.0f));
  for (int r = 0; r < T; ++r)
    for (int i = 0; i < w; ++i) x[r * ld + i] = float_to_bf16(float(10 * r + i));
  std::vector<int32_t> sel = {3, 1, 0, 2, 5, 4, 7, 6, 9, 8};
  std::vector<float> wt = {.1f, .2f, .3f, .4f, .5f, .6f, .7f, .8f, .9f, 1.f};
  tr.after(op_event(OpKind::kFfnSublayer, 1, 0, {bf16_ref(x.data(), T, w, ld), {}, {}}));
  EXPECT_EQ(sink.get(1, 1, "ffn_in").f, (std::vector<float>{20, 21, 30, 31, 40, 41}));
  tr.after(op_event(OpKind::kMoe, 1, 0,
                    {{}, {}, i32_ref(sel.data(), T, K), f32_ref(wt.data(), T, K), {}}));
  // Expert ids keep the kernel's order (not sorted).
  EXPECT_EQ(sink.get(1, 0, "route.experts").i, (std::vector<int32_t>{3, 1, 0, 2}));
  EXPECT_EQ(sink.get(1, 1, "route.weights").f, (std::vector<float>{.5f, .6f, .7f, .8f, .9f, 1.f}));
}

TEST(TraceObserver, IndexerSelectionSortedAndPerChunkScores) {
  const int K = 4;
  Sink sink;
  TraceObserver tr = host_tracer(sink, 2, 3);
  const std::vector<ChunkRef> chunks = two_chunks();
  tr.after(step_begin(chunks));
  // The step's rows (the GPU's event): each row ascending, -1 at the end; no scores.
  std::vector<int32_t> sel = {5, -1, 2, 0, 1, 3, -1, -1, 9, 8, 7, 6, -1, 4, -1, 2, 3, 2, 1, 0};
  tr.after(op_event(OpKind::kIndexer, 2, 0, {{}, {}, {}, {}, {}, i32_ref(sel.data(), 5, K)}));
  EXPECT_EQ(sink.get(2, 0, "indexer.selected").i,
            (std::vector<int32_t>{0, 2, 5, -1, 1, 3, -1, -1}));
  EXPECT_EQ(sink.get(2, 1, "indexer.selected").i,
            (std::vector<int32_t>{6, 7, 8, 9, 2, 4, -1, -1, 0, 1, 2, 3}));
  EXPECT_FALSE(sink.has(2, 0, "indexer.scores"));
  // One chunk's rows (the CPU's event), with scores [rows, keys].
  std::vector<int32_t> sel1 = {1, 0, -1, -1};
  std::vector<float> scores = {0.5f, 0.25f, -INFINITY};
  OpEvent e = op_event(OpKind::kIndexer, 3, 0, {});
  e.chunk = 1;
  e.t[5] = i32_ref(sel1.data(), 1, K);
  e.t[6] = f32_ref(scores.data(), 1, 3);
  tr.after(e);
  EXPECT_EQ(sink.get(3, 1, "indexer.selected").i, (std::vector<int32_t>{0, 1, -1, -1}));
  const Recorded& sc = sink.get(3, 1, "indexer.scores");
  EXPECT_EQ(sc.shape, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(sc.f, scores);
  EXPECT_FALSE(sink.has(3, 0, "indexer.selected"));
}

TEST(OpObservers, CallsInOrderAndRemoves) {
  struct Log : OpObserver {
    Log(std::string* out, char tag) : out(out), tag(tag) {}
    void before(const OpEvent&) override { *out += char(tag - 32); }
    void after(const OpEvent&) override { *out += tag; }
    std::string* out;
    char tag;
  };
  std::string log;
  Log a(&log, 'a'), b(&log, 'b');
  OpObservers list;
  EXPECT_TRUE(list.empty());
  list.add(&a);
  list.add(nullptr);  // ignored
  list.add(&b);
  list.before(OpEvent{});
  list.after(OpEvent{});
  EXPECT_EQ(log, "ABab");
  list.remove(&a);
  list.after(OpEvent{});
  EXPECT_EQ(log, "ABabb");
  list.remove(&b);
  EXPECT_TRUE(list.empty());
}

TEST(OpEvent, LinearNamesMatchTheCpuWeights) {
  EXPECT_STREQ(op_name(LinearId::kWqA), "attn.wq_a");
  EXPECT_STREQ(op_name(LinearId::kIndexCompWgate), "indexer.compressor.wgate");
  EXPECT_STREQ(op_name(LinearId::kSharedW2), "shared_expert.w2");
  EXPECT_STREQ(op_name(LinearId::kHProj), "mtp.h_proj");
  EXPECT_STREQ(op_name(NormId::kHnorm), "mtp.hnorm");
}

}  // namespace
}  // namespace dsv4
