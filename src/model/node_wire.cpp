#include "model/node_wire.h"

#include <cstring>

#include "core/error.h"

namespace dsv4 {

void WireWriter::raw(const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  bytes_.insert(bytes_.end(), b, b + n);
}
void WireWriter::i64(int64_t v) {
  raw(&v, 8);
}
void WireWriter::f64(double v) {
  raw(&v, 8);
}
void WireWriter::str(const std::string& s) {
  i64(int64_t(s.size()));
  raw(s.data(), s.size());
}
void WireWriter::ints(const std::vector<int>& v) {
  i64(int64_t(v.size()));
  for (int x : v) i64(x);
}
void WireWriter::ids(const int32_t* p, size_t n) {
  i64(int64_t(n));
  raw(p, n * sizeof(int32_t));
}
void WireWriter::floats(const std::vector<float>& v) {
  i64(int64_t(v.size()));
  raw(v.data(), v.size() * sizeof(float));
}

void WireReader::raw(void* p, size_t n) {
  DSV4_CHECK(n <= b_.size() - at_, "multi-node: a truncated message from another node");
  std::memcpy(p, b_.data() + at_, n);
  at_ += n;
}
uint8_t WireReader::u8() {
  uint8_t v = 0;
  raw(&v, 1);
  return v;
}
int64_t WireReader::i64() {
  int64_t v = 0;
  raw(&v, 8);
  return v;
}
double WireReader::f64() {
  double v = 0;
  raw(&v, 8);
  return v;
}
std::string WireReader::str() {
  const int64_t n = i64();
  DSV4_CHECK(n >= 0 && size_t(n) <= b_.size() - at_, "multi-node: a truncated message");
  std::string s(size_t(n), '\0');
  raw(s.data(), size_t(n));
  return s;
}
std::vector<int> WireReader::ints() {
  const int64_t n = i64();
  DSV4_CHECK(n >= 0 && size_t(n) <= (b_.size() - at_) / 8, "multi-node: a truncated message");
  std::vector<int> v(static_cast<size_t>(n));
  for (int& x : v) x = int(i64());
  return v;
}
std::vector<int32_t> WireReader::ids() {
  const int64_t n = i64();
  DSV4_CHECK(n >= 0 && size_t(n) <= (b_.size() - at_) / 4, "multi-node: a truncated message");
  std::vector<int32_t> v(static_cast<size_t>(n));
  raw(v.data(), v.size() * 4);
  return v;
}
std::vector<float> WireReader::floats() {
  const int64_t n = i64();
  DSV4_CHECK(n >= 0 && size_t(n) <= (b_.size() - at_) / 4, "multi-node: a truncated message");
  std::vector<float> v(static_cast<size_t>(n));
  raw(v.data(), v.size() * 4);
  return v;
}

void put_sequence(WireWriter& w, const SequenceCache& s) {
  w.i64(s.tokens);
  w.i64(s.mtp_tokens);
  w.i64(s.state_slot);
  for (int k = 0; k < kNumPageKinds; ++k) w.ints(s.pages[k]);
}

SequenceCache get_sequence(WireReader& r) {
  SequenceCache s;
  s.tokens = r.i64();
  s.mtp_tokens = r.i64();
  s.state_slot = int(r.i64());
  for (int k = 0; k < kNumPageKinds; ++k) s.pages[k] = r.ints();
  return s;
}

void put_copies(WireWriter& w, const std::vector<PageCopy>& copies) {
  w.i64(int64_t(copies.size()));
  for (const PageCopy& c : copies) {
    w.u8(uint8_t(c.kind));
    w.i64(c.from);
    w.i64(c.to);
  }
}

std::vector<PageCopy> get_copies(WireReader& r) {
  const int64_t n = r.i64();
  DSV4_CHECK(n >= 0 && n < (int64_t(1) << 32), "multi-node: a bad page-copy count");
  std::vector<PageCopy> c(static_cast<size_t>(n));
  for (PageCopy& x : c) {
    const uint8_t k = r.u8();
    DSV4_CHECK(k < kNumPageKinds, "multi-node: a bad page kind");
    x.kind = PageKind(k);
    x.from = int(r.i64());
    x.to = int(r.i64());
  }
  return c;
}

void put_batches(WireWriter& w, const std::vector<StepBatch>& batches) {
  w.i64(int64_t(batches.size()));
  for (const StepBatch& b : batches) {
    w.i64(b.dp_rank);
    w.i64(int64_t(b.chunks.size()));
    for (const ChunkRef& c : b.chunks) {
      put_sequence(w, *c.cache);
      w.i64(c.start);
      w.ids(c.tokens, size_t(c.n));
    }
    w.ints(b.rows);
    w.i64(b.num_logit_rows);
    w.u8(b.decode_only);
  }
}

std::unique_ptr<ReceivedStep> get_batches(WireReader& r) {
  auto s = std::make_unique<ReceivedStep>();
  const int64_t groups = r.i64();
  DSV4_CHECK(groups >= 0 && groups <= 1 << 20, "multi-node: a bad group count");
  for (int64_t g = 0; g < groups; ++g) {
    StepBatch b;
    b.dp_rank = int(r.i64());
    const int64_t n = r.i64();
    DSV4_CHECK(n >= 0 && n <= 1 << 24, "multi-node: a bad chunk count");
    for (int64_t i = 0; i < n; ++i) {
      s->sequences.push_back(get_sequence(r));
      const int64_t start = r.i64();
      s->tokens.push_back(r.ids());
      const std::vector<int32_t>& t = s->tokens.back();
      b.chunks.push_back({&s->sequences.back(), start, t.data(), int(t.size())});
    }
    b.rows = r.ints();
    b.num_logit_rows = int(r.i64());
    b.decode_only = r.u8() != 0;
    s->batches.push_back(std::move(b));
  }
  return s;
}

void put_runner_options(WireWriter& w, const RunnerOptions& o) {
  w.i64(o.page_size);
  w.i64(o.max_sequences);
  w.i64(o.snapshot_slots);
  w.i64(o.max_tokens);
  w.i64(o.cache_bytes);
  w.i64(o.max_step_tokens);
  w.u8(o.verify);
  w.u8(o.cuda_graphs);
  w.u8(o.exact_linears);
  w.i64(o.dp);
  w.i64(o.ep);
  w.i64(o.tp);
  w.str(o.parallel_comm);
  w.i64(o.nnodes);
}

void get_runner_options(WireReader& r, RunnerOptions& o) {
  o.page_size = int(r.i64());
  o.max_sequences = int(r.i64());
  o.snapshot_slots = int(r.i64());
  o.max_tokens = r.i64();
  o.cache_bytes = r.i64();
  o.max_step_tokens = int(r.i64());
  o.verify = r.u8() != 0;
  o.cuda_graphs = r.u8() != 0;
  o.exact_linears = r.u8() != 0;
  o.dp = int(r.i64());
  o.ep = int(r.i64());
  o.tp = int(r.i64());
  o.parallel_comm = r.str();
  o.nnodes = int(r.i64());
}

}  // namespace dsv4
