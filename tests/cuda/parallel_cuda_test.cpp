// The CUDA backend's parallel engine with its ranks as threads on one GPU over the in-process
// device communicator (a test facility: the same ParallelCudaRunner runs over NCCL with a GPU
// per rank), against the one-rank CUDA backend:
//  - the in-process device collectives move bytes exactly (all-gather, all-to-all(v) with
//    empty entries, split), with the ranks' streams ordered only by events;
//  - the parallel runner with one rank (nothing to exchange) gives CudaRunner's logits bit for
//    bit, over the in-process and the NCCL communicator (a world of one);
//  - for every (dp, ep, tp) tuple of the issue, on both make-tiny presets and the golden
//    checkpoints when present: prompt logits of one prefill, of 17-token chunks and of
//    token-by-token decode steps within the golden README's end-to-end tolerance of one rank
//    (E2eTolerance). One request per call, so with dp 2 one data-parallel group has no work
//    and joins the MoE exchanges with empty batches. Then six requests served at once (both
//    groups busy, groups finishing at different steps), twice: no request fails, and the two
//    runs give the same tokens and logprobs bit for bit (the parallel forward is deterministic:
//    every collective only moves data, the combine sums in ascending expert index);
//  - what cannot hold bit for bit with one rank (why logits are held to the tolerance, not to
//    identity): the FP8 GEMMs' stream-K partials follow the number of output tiles, so wq_b
//    and the indexer's wq_b over a tensor-parallel share of the rows sum in another order; the
//    MoE owner's token tile follows its own batch (moe_default_tile_n); a dp group's batch
//    differs from the one-rank batch, and the kernels are not batch-invariant
//    (engine_parity_test);
//  - a tensor-parallel share of heads the sparse attention does not take (flash: 4 heads, tp 2
//    leaves 2) runs padded with zero queries (CudaBlockWeights::attn_heads);
//  - decode steps as CUDA graphs with several ranks equal the same steps run eagerly, logits and
//    cache stores byte for byte (DecodeGraphsEqualEagerStepsBitForBit);
//  - a size mismatch inside a replayed graph's in-process collective fails when the stream
//    completes (check_completed), not at some later collective;
//  - verify mode, an unknown communicator and a tuple that does not divide are clear errors;
//  - a multi-node start over NCCL never hangs in NCCL's set-up: node 1 (a thread of this
//    process following the start protocol over the rendezvous) confirms the start, then fails
//    or goes silent; node 0's runner ends at once as a consequence (CollectiveAborted) or at
//    its set-up deadline (NcclStartNeverHangs).
#include <gtest/gtest.h>
#include <filesystem>

#include <cuda_runtime.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>

#include "backends/cuda/backend.h"
#include "backends/cuda/parallel_runner.h"
#include "comm/collective_aborted.h"
#include "comm/inproc_device_communicator.h"
#include "comm/rendezvous.h"
#include "core/error.h"
#include "cuda/engine_test_support.h"
#include "dsv4/engine.h"
#include "io/checkpoint.h"
#include "model/cache_spec.h"
#include "model/model_config.h"
#include "model/tiny_checkpoint.h"
#include "ops/cuda/common/device_buffer.h"
#include "support/golden.h"
#include "support/rank_threads.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

// The in-process device collectives wait on the device for other ranks' launches: every kernel
// is loaded when CUDA starts (lazy loading may synchronise the context while one waits;
// inproc_device_communicator.h), before the first CUDA call of this process.
const bool kEagerModuleLoading = [] { return setenv("CUDA_MODULE_LOADING", "EAGER", 1) == 0; }();

struct Tuple {
  int dp, ep, tp;
};
const Tuple kTuples[] = {{1, 2, 1}, {2, 2, 1}, {1, 4, 1}, {1, 1, 2}, {2, 2, 2}};

std::string name(const Tuple& t) {
  return "dp" + std::to_string(t.dp) + " ep" + std::to_string(t.ep) + " tp" + std::to_string(t.tp);
}

EngineOptions options(const std::string& dir, const Tuple& t, const std::string& comm = "inproc",
                      int seqs = 4) {
  EngineOptions o;
  o.model_dir = dir;
  o.backend = "cuda";
  o.page_size = 16;
  o.max_sequences = seqs;
  o.max_tokens = 80;
  o.max_step_tokens = 80;
  o.cache_bytes = 64ll << 20;
  o.cuda_graphs = false;  // eager here (DecodeGraphsEqualEagerStepsBitForBit: graphs)
  o.dp = t.dp;
  o.ep = t.ep;
  o.tp = t.tp;
  o.parallel_comm = comm;
  // No prefix cache: a second serve of the same requests then runs the same steps (a hit would
  // change the batches, and the kernels are not batch-invariant).
  o.prefix_snapshots = 0;
  return o;
}

struct Served {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<TokenLogprob>> logprobs;
};

// Six requests of mixed lengths and sampling, all queued at once.
Served serve(Engine& e, int vocab) {
  std::mt19937 rng(23);
  Served s;
  std::map<uint64_t, size_t> index;
  const int lens[] = {37, 5, 20, 1, 50, 12};
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> p{0};
    while (int(p.size()) < lens[i]) p.push_back(2 + int32_t(rng() % uint32_t(vocab - 2)));
    SamplingOptions o;
    o.max_new_tokens = 5 + i;  // the groups finish at different steps
    o.stop_at_eos = false;
    o.seed = 7 + uint64_t(i);
    o.temperature = i % 2 ? 0.9f : 0.0f;
    o.logprobs = true;
    o.top_logprobs = 2;
    index[e.add_request(p, o, 1)] = size_t(i);
  }
  s.tokens.resize(6);
  s.logprobs.resize(6);
  while (e.has_work())
    for (const RequestOutput& o : e.step()) {
      EXPECT_NE(o.finish, FinishReason::kError) << o.error;
      const size_t i = index.at(o.request);
      s.tokens[i].insert(s.tokens[i].end(), o.tokens.begin(), o.tokens.end());
      s.logprobs[i].insert(s.logprobs[i].end(), o.logprobs.begin(), o.logprobs.end());
    }
  for (int i = 0; i < 6; ++i) EXPECT_EQ(int(s.tokens[size_t(i)].size()), 5 + i) << "request " << i;
  return s;
}

void expect_same(const Served& got, const Served& want, const std::string& what) {
  for (size_t i = 0; i < want.tokens.size(); ++i) {
    EXPECT_EQ(got.tokens[i], want.tokens[i]) << what << " request " << i;
    ASSERT_EQ(got.logprobs[i].size(), want.logprobs[i].size()) << what;
    for (size_t k = 0; k < want.logprobs[i].size(); ++k) {
      EXPECT_EQ(got.logprobs[i][k].logprob, want.logprobs[i][k].logprob) << what;
      EXPECT_EQ(got.logprobs[i][k].top, want.logprobs[i][k].top) << what;
    }
  }
}

int world(const Tuple& t) {
  return std::max(t.dp * t.tp, t.ep);
}

// Every tuple against one rank on one model directory. "nccl": only the tuples this machine
// has a GPU per rank for.
void check_model(const std::string& dir, const std::string& comm = "inproc") {
  const ModelConfig c = load_model_config(dir + "/config.json");
  std::mt19937 rng(3);
  std::vector<int32_t> prompt{0};
  while (prompt.size() < 70) prompt.push_back(2 + int32_t(rng() % uint32_t(c.vocab_size - 2)));
  const int V = c.vocab_size;
  std::unique_ptr<Engine> ref = Engine::open(options(dir, {1, 1, 1}));
  const std::vector<float> want = ref->prompt_logits(prompt, 0);
  const std::vector<float> want_chunked = ref->prompt_logits(prompt, 17);
  const std::vector<float> want_decode = ref->prompt_logits(prompt, 1);
  ref.reset();
  for (const Tuple& t : kTuples) {
    SCOPED_TRACE(name(t));
    if (comm == "nccl" && world(t) > cuda::device_count()) continue;
    std::printf("  %s over %s\n", name(t).c_str(), comm.c_str());
    std::unique_ptr<Engine> e = Engine::open(options(dir, t, comm));
    // One request: with dp 2 the other data-parallel group has no work.
    const std::vector<float> got = e->prompt_logits(prompt, 0);
    expect_logits_close(name(t) + " prefill", got, want, V);
    expect_logits_close(name(t) + " 17-token chunks", e->prompt_logits(prompt, 17), want_chunked,
                        V);
    expect_logits_close(name(t) + " decode steps", e->prompt_logits(prompt, 1), want_decode, V);
    // Run to run: the same bits.
    const std::vector<float> again = e->prompt_logits(prompt, 0);
    ASSERT_EQ(again.size(), got.size());
    EXPECT_EQ(std::memcmp(again.data(), got.data(), got.size() * 4), 0) << "not deterministic";
    const Served first = serve(*e, V);
    expect_same(serve(*e, V), first, name(t) + " served twice");
    EXPECT_EQ(e->stats().cache_usage, 0.0);
  }
}

class ParallelCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    DSV4_SKIP_WITHOUT_GPU();
    register_cuda_backend();
  }
};

// One rank of InProcessDeviceCollectivesMoveBytesExactly.
void body_of_collectives_test(int r, int n, DeviceCommunicator& c, std::vector<int>& bad,
                              std::vector<int>& sub_rank, std::vector<int>& sub_size) {
  DSV4_CUDA_CHECK(cudaSetDevice(0));
  cudaStream_t s;
  DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // all-gather of 1000 floats: rank r sends r * 1000 + k.
  std::vector<float> mine(1000);
  for (int k = 0; k < 1000; ++k) mine[size_t(k)] = float(r * 1000 + k);
  cuda::DeviceBuffer<float> dmine(mine), all(size_t(1000 * n));
  // The send buffer is rewritten right after: the collective must not let the stream run
  // ahead of the other ranks' reads.
  c.all_gather(dmine.data(), all.data(), 4000, s);
  DSV4_CUDA_CHECK(cudaMemsetAsync(dmine.data(), 0xff, 4000, s));
  // all-to-all(v): rank r sends (r + d) % 3 floats of value 100 r + d to rank d (zero
  // sometimes: an idle pair still takes part).
  std::vector<size_t> so, sb, ro, rb;
  std::vector<float> send;
  for (int d = 0; d < n; ++d) {
    so.push_back(send.size() * 4);
    sb.push_back(size_t((r + d) % 3) * 4);
    send.insert(send.end(), size_t((r + d) % 3), float(100 * r + d));
  }
  size_t total = 0;
  for (int src = 0; src < n; ++src) {
    ro.push_back(total * 4);
    rb.push_back(size_t((src + r) % 3) * 4);
    total += size_t((src + r) % 3);
  }
  cuda::DeviceBuffer<float> dsend(send.empty() ? std::vector<float>{0} : send),
      drecv(std::max<size_t>(1, total));
  c.all_to_all_v(dsend.data(), so, sb, drecv.data(), ro, rb, s);
  // split: {0, 2} ordered by key (2 first), {1}; an all-gather inside.
  auto sub = c.split(r % 2, -r);
  sub_rank[size_t(r)] = sub->rank();
  sub_size[size_t(r)] = sub->size();
  cuda::DeviceBuffer<int> one(std::vector<int>{r}), both(size_t(sub->size()));
  // The groups' collectives do not meet each other on the host: without this world meeting,
  // rank 1 (alone in its group) can be inside the split's cudaHostAlloc or these buffers'
  // cudaMalloc / cudaMemcpy (calls that may wait for the whole device) while rank 2 already
  // spins on the device for rank 0's launch — which waits behind rank 1's call: the hang seen
  // on one H200 at stop 31 (the test never finished). After it, every rank's host work until
  // the next meeting is launches and its own stream's synchronisation.
  c.launch_barrier();
  sub->all_gather(one.data(), both.data(), 4, s);
  DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
  // Rank 1 is alone in its group: without this meeting it can reach cudaFree (a context-wide
  // synchronisation) while ranks 0 and 2 are between their group's host meeting and their
  // launches, one of them already spinning on the device for the other's launch.
  c.launch_barrier();
  c.check_completed();  // a collective that gave up waiting says so, with each rank's counters
  sub->check_completed();
  const std::vector<float> a = all.download();
  for (int k = 0; k < 1000 * n; ++k) bad[size_t(r)] += a[size_t(k)] != float(k);
  const std::vector<float> got = drecv.download();
  size_t at = 0;
  for (int src = 0; src < n; ++src)
    for (int k = 0; k < (src + r) % 3; ++k) bad[size_t(r)] += got[at++] != float(100 * src + r);
  const std::vector<int> b = both.download();
  const std::vector<int> want_b = r == 1 ? std::vector<int>{1} : std::vector<int>{2, 0};
  bad[size_t(r)] += b != want_b;
  DSV4_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST_F(ParallelCuda, InProcessDeviceCollectivesMoveBytesExactly) {
  const int n = 3;
  // A collective whose kernels wait past 20 s fails (with what each rank had reached) instead
  // of hanging the suite.
  auto comms = make_inproc_device_communicators(n, 20.0);
  std::vector<int> bad(n, 0);
  std::vector<int> sub_rank(n), sub_size(n);
  on_each_rank(n, [&](int r) {
    DeviceCommunicator& c = *comms[size_t(r)];
    try {
      body_of_collectives_test(r, n, c, bad, sub_rank, sub_size);
    } catch (...) {
      c.abort();  // the other ranks' meetings and collectives fail instead of waiting for this one
      throw;
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(bad[size_t(r)], 0) << "rank " << r;
  EXPECT_EQ(sub_size, (std::vector<int>{2, 1, 2}));
  EXPECT_EQ(sub_rank, (std::vector<int>{1, 0, 0}));
}

// A collective replayed from a CUDA graph runs without the host, so a receiver that expects
// other sizes than were sent cannot throw at the call: check_completed() reports it once the
// stream completed (the parallel runner calls it after every step). Two ranks capture an
// all-to-all(v) in which rank 0 expects 8 bytes from rank 1: first with rank 1 sending 8 (the
// replay moves them, no false alarm), then sending 4 (the replay copies nothing, and
// check_completed() throws on rank 0, before any later collective).
TEST_F(ParallelCuda, InProcessGraphReplayWithMismatchedSizesFailsWhenItCompletes) {
  for (const size_t sent : {size_t(8), size_t(4)}) {
    SCOPED_TRACE(sent);
    auto comms = make_inproc_device_communicators(2);
    std::vector<std::string> error(2);
    std::vector<std::vector<uint8_t>> got(2);
    on_each_rank(2, [&](int r) {
      DSV4_CUDA_CHECK(cudaSetDevice(0));
      DeviceCommunicator& c = *comms[size_t(r)];
      cudaStream_t s;
      DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      cuda::DeviceBuffer<uint8_t> send(std::vector<uint8_t>(8, uint8_t(10 + r)));
      cuda::DeviceBuffer<uint8_t> recv(std::vector<uint8_t>(8, 0xee));
      // Only rank 1 sends, only to rank 0.
      const std::vector<size_t> zero{0, 0};
      const std::vector<size_t> sb = r == 1 ? std::vector<size_t>{sent, 0} : zero;
      const std::vector<size_t> rb = r == 0 ? std::vector<size_t>{0, 8} : zero;
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      DSV4_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      c.all_to_all_v(send.data(), zero, sb, recv.data(), zero, rb, s);
      DSV4_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
      DSV4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      c.launch_barrier();
      DSV4_CUDA_CHECK(cudaGraphLaunch(exec, s));
      c.launch_barrier();
      DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
      try {
        c.check_completed();
      } catch (const Error& e) {
        error[size_t(r)] = e.what();
      }
      got[size_t(r)] = recv.download();
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      DSV4_CUDA_CHECK(cudaStreamDestroy(s));
    });
    if (sent == 8) {
      EXPECT_EQ(error[0], "");
      EXPECT_EQ(error[1], "");
      EXPECT_EQ(got[0], std::vector<uint8_t>(8, 11));  // rank 1's bytes
    } else {
      EXPECT_NE(error[0].find("expected other sizes than were sent"), std::string::npos)
          << error[0];
      EXPECT_NE(error[0].find("rank 0 of 2"), std::string::npos) << error[0];
      EXPECT_EQ(got[0], std::vector<uint8_t>(8, 0xee));  // nothing copied
    }
    EXPECT_EQ(got[1], std::vector<uint8_t>(8, 0xee));  // rank 1 receives nothing
  }
}

TEST_F(ParallelCuda, EveryTupleWithinToleranceOfOneRankOnMakeTinyPresets) {
  for (const char* preset : {"flash", "pro"}) {
    TempDir d;
    write_tiny_checkpoint(tiny_preset(preset), ExpertFormat::kNvfp4, 8, d.path(),
                          tiny_init(preset));
    SCOPED_TRACE(preset);
    std::printf("[%s]\n", preset);
    check_model(d.path());
  }
}

TEST_F(ParallelCuda, EveryTupleWithinToleranceOfOneRankOnTheGoldenCheckpoints) {
  const std::string root = golden_root();
  if (root.empty()) GTEST_SKIP() << "golden data not found";
  // Every set and format that is there (the H200 run carries one of each).
  int checked = 0;
  for (const char* set : {"tiny-flash", "tiny-pro"})
    for (const char* fmt : {"hf-mxfp4", "hf-nvfp4"}) {
      const std::string dir = root + "/" + set + "/" + fmt;
      if (!std::filesystem::exists(dir + "/config.json")) continue;
      SCOPED_TRACE(dir);
      std::printf("[%s %s]\n", set, fmt);
      check_model(dir);
      ++checked;
    }
  if (checked == 0) GTEST_SKIP() << "no golden checkpoint under " << root;
}

// The same runner over NCCL with a GPU per rank (threads of this process): the tuples that fit
// the visible GPUs (none on one GPU: NCCL takes one rank per device).
TEST_F(ParallelCuda, TuplesOverNcclWithinToleranceOfOneRank) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "NCCL with several ranks needs several GPUs";
  for (const char* preset : {"flash", "pro"}) {
    TempDir d;
    write_tiny_checkpoint(tiny_preset(preset), ExpertFormat::kNvfp4, 8, d.path(),
                          tiny_init(preset));
    SCOPED_TRACE(preset);
    std::printf("[%s, %d GPUs]\n", preset, cuda::device_count());
    check_model(d.path(), "nccl");
  }
}

// The parallel runner with one rank has nothing to exchange, so its forward is the one-rank
// model's: the same logits bit for bit as CudaRunner (eager), over either communicator (the
// NCCL one: a world of one, split into groups of one).
TEST_F(ParallelCuda, OneRankRunnerEqualsTheCudaRunnerBitForBit) {
  for (const char* preset : {"flash", "pro"}) {
    SCOPED_TRACE(preset);
    TempDir d;
    write_tiny_checkpoint(tiny_preset(preset), ExpertFormat::kMxfp4, 5, d.path(),
                          tiny_init(preset));
    CudaStackOptions so;
    so.max_seqs = 2;
    so.max_context = 320;
    so.max_step_tokens = 160;
    std::unique_ptr<CudaStack> one = open_cuda_stack(d.path(), so);
    std::mt19937 rng(11);
    std::vector<int32_t> toks{one->config.bos_token_id};
    while (toks.size() < 150) toks.push_back(2 + int32_t(rng() % uint32_t(one->V() - 2)));
    const std::vector<float> want = forced_logits(*one->runner, toks, 130, 0);
    const QuantScheme scheme = QuantScheme::load(d.path(), one->config);
    Checkpoint ckpt(d.path());
    const WeightsRef ref = bind_weights(ckpt, one->config, scheme);
    CudaModelLimits lim;
    lim.max_tokens = so.max_step_tokens;
    lim.max_seqs = so.max_seqs;
    lim.max_context = so.max_context;
    const CacheConfig cc = cache_capacity(one->config, so.max_seqs, so.max_context, so.page_size);
    for (CudaCommKind kind : {CudaCommKind::kInProcess, CudaCommKind::kNccl}) {
      const char* what = kind == CudaCommKind::kNccl ? "nccl" : "inproc";
      ParallelCudaOptions po;
      po.comm = kind;
      std::unique_ptr<ParallelCudaRunner> r;
      try {
        r = std::make_unique<ParallelCudaRunner>(one->config, ref, ParallelConfig{1, 1, 1}, cc, lim,
                                                 po);
      } catch (const Error& e) {
        if (kind == CudaCommKind::kNccl &&
            std::string(e.what()).find("no NCCL") != std::string::npos) {
          std::printf("  %s: %s\n", what, e.what());
          continue;
        }
        throw;
      }
      const std::vector<float> got = forced_logits(*r, toks, 130, 0);
      ASSERT_EQ(got.size(), want.size()) << what;
      EXPECT_EQ(first_diff_row(got, want, one->V()), size_t(-1)) << what;
      std::printf("  [%s] one-rank parallel runner over %s: %s\n", preset, what,
                  got == want ? "bit-identical" : "DIFFERS");
    }
  }
}

// Decode steps as CUDA graphs with several ranks (parallel_runner.h): every rank captures its
// step (the MoE's decode exchange with counts on the device, the in-process collectives as
// device-side copies), later steps replay with other tokens and positions. Three sequences of
// different lengths, prefilled one per step (eager), then decode steps of batch 1 (with dp 2
// the other group idle: its MoE exchanges captured too), of all three (dp 2: groups of 2 and 1
// sequences), and of two: each shape runs eagerly once, then captures, then replays. The graph
// runner's logits and every rank's cache stores equal, byte for byte, those of a runner that
// runs the same shapes eagerly (graphs off, bucketed launch bounds, the same graph sizes so the
// same exchange capacity), and the logits stay within the end-to-end tolerance of CudaRunner.
// The same for NCCL with one rank.
struct DecodeRun {
  std::vector<float> logits;
  std::vector<std::vector<uint8_t>> stores;  // every rank's, block's and kind's bytes
  int64_t graph_steps = 0, replays = 0;
};

std::vector<std::vector<uint8_t>> cache_bytes(ParallelCudaRunner& r, int world, int blocks) {
  std::vector<std::vector<uint8_t>> out;
  for (int w = 0; w < world; ++w)
    for (int b = 0; b < blocks; ++b)
      for (int kind = 0; kind < 3; ++kind) {
        const auto [base, n] = r.cache(w).store_range(b, kind);
        std::vector<uint8_t> h(size_t(std::max<int64_t>(0, n)));
        if (base && n > 0)
          DSV4_CUDA_CHECK(cudaMemcpy(h.data(), base, size_t(n), cudaMemcpyDeviceToHost));
        out.push_back(std::move(h));
      }
  return out;
}

// The steps of the test on any runner (sequences a, c on dp group 0, b on group 1 when there
// are two).
std::vector<float> decode_steps(Runner& r, int vocab) {
  std::mt19937 rng(5);
  auto tok = [&] { return 2 + int32_t(rng() % uint32_t(vocab - 2)); };
  const int groups = r.dp_size();
  const int a = r.open_sequence_on(0), b = r.open_sequence_on(1 % groups),
            c = r.open_sequence_on(0);
  std::vector<float> out;
  auto step = [&](const std::vector<StepInput>& in) {
    const std::vector<float> l = r.step_logits(in);
    out.insert(out.end(), l.begin(), l.end());
  };
  for (auto [seq, len] : {std::pair{a, 30}, std::pair{b, 17}, std::pair{c, 45}}) {
    std::vector<int32_t> p{0};
    while (int(p.size()) < len) p.push_back(tok());
    step({{seq, p}});
  }
  for (int i = 0; i < 6; ++i) step({{a, {tok()}}});
  for (int i = 0; i < 6; ++i) step({{a, {tok()}}, {b, {tok()}}, {c, {tok()}}});
  for (int i = 0; i < 3; ++i) step({{b, {tok()}}, {c, {tok()}}});
  for (int s : {a, b, c}) r.close_sequence(s);
  return out;
}

TEST_F(ParallelCuda, DecodeGraphsEqualEagerStepsBitForBit) {
  TempDir d;
  write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kNvfp4, 8, d.path(),
                        tiny_init("flash"));
  CudaStackOptions so;
  so.max_seqs = 4;
  so.max_context = 320;
  so.max_step_tokens = 80;
  so.page_size = 16;
  std::unique_ptr<CudaStack> one = open_cuda_stack(d.path(), so);
  const int V = one->V(), L = one->config.n_layers;
  const std::vector<float> want = decode_steps(*one->runner, V);
  const QuantScheme scheme = QuantScheme::load(d.path(), one->config);
  Checkpoint ckpt(d.path());
  const WeightsRef ref = bind_weights(ckpt, one->config, scheme);
  CudaModelLimits lim;
  lim.max_tokens = so.max_step_tokens;
  lim.max_seqs = so.max_seqs;
  lim.max_context = so.max_context;
  const CacheConfig cc = cache_capacity(one->config, so.max_seqs, so.max_context, so.page_size);
  struct Case {
    Tuple t;
    CudaCommKind comm;
  };
  const Case cases[] = {{{1, 2, 1}, CudaCommKind::kInProcess},
                        {{2, 2, 1}, CudaCommKind::kInProcess},
                        {{1, 4, 1}, CudaCommKind::kInProcess},
                        {{2, 2, 2}, CudaCommKind::kInProcess},
                        {{1, 1, 1}, CudaCommKind::kNccl}};
  for (const Case& k : cases) {
    const std::string what =
        name(k.t) + (k.comm == CudaCommKind::kNccl ? " over nccl" : " over inproc");
    SCOPED_TRACE(what);
    auto run = [&](bool graphs) {
      ParallelCudaOptions po;
      po.comm = k.comm;
      po.cuda_graphs = graphs;
      po.bucket_eager_decode = !graphs;
      po.graph_batch_sizes = {1, 2, 3, 4};  // every batch of the test: nothing padded
      ParallelCudaRunner r(one->config, ref, ParallelConfig{k.t.dp, k.t.ep, k.t.tp}, cc, lim, po);
      DecodeRun out;
      out.logits = decode_steps(r, V);
      out.stores = cache_bytes(r, world(k.t), L);
      out.graph_steps = r.graph_steps();
      for (int w = 0; w < world(k.t); ++w) out.replays += r.graph_replays(w);
      EXPECT_EQ(r.padded_steps(), 0);
      return out;
    };
    DecodeRun g, e;
    try {
      g = run(true);
      e = run(false);
    } catch (const Error& x) {
      if (k.comm == CudaCommKind::kNccl &&
          std::string(x.what()).find("no NCCL") != std::string::npos) {
        std::printf("  %s: %s\n", what.c_str(), x.what());
        continue;
      }
      throw;
    }
    // Batch 1, 3 and 2: each shape once eagerly, then 5, 5 and 2 graph steps.
    EXPECT_EQ(g.graph_steps, 12);
    EXPECT_EQ(e.graph_steps, 0);
    EXPECT_GE(g.replays, int64_t(world(k.t)) * 8) << "graphs not replayed";
    std::printf("  %s: %lld graph steps, %lld replays over the ranks\n", what.c_str(),
                (long long)g.graph_steps, (long long)g.replays);
    ASSERT_EQ(g.logits.size(), want.size());
    ASSERT_EQ(e.logits.size(), want.size());
    EXPECT_EQ(first_diff_row(g.logits, e.logits, V), size_t(-1)) << "graph logits differ";
    ASSERT_EQ(g.stores.size(), e.stores.size());
    size_t differ = 0;
    for (size_t i = 0; i < g.stores.size(); ++i) differ += g.stores[i] != e.stores[i];
    EXPECT_EQ(differ, 0u) << "cache stores of graph and eager runs differ";
    expect_logits_close(what + " graphs vs one rank", g.logits, want, V);
  }
}

// The engine with CUDA graphs on (the default) and several ranks: token-by-token decode logits
// within the tolerance of one rank (eager), and six requests served twice give the same tokens
// and logprobs (the second serve replays what the first captured; batches of 3 run padded to 4).
TEST_F(ParallelCuda, EngineWithGraphsServesTheSameTwice) {
  TempDir d;
  write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kNvfp4, 8, d.path(),
                        tiny_init("flash"));
  const ModelConfig c = load_model_config(d.path() + "/config.json");
  std::mt19937 rng(9);
  std::vector<int32_t> prompt{0};
  while (prompt.size() < 40) prompt.push_back(2 + int32_t(rng() % uint32_t(c.vocab_size - 2)));
  const std::vector<float> want =
      Engine::open(options(d.path(), {1, 1, 1}))->prompt_logits(prompt, 1);
  for (const Tuple& t : {Tuple{1, 2, 1}, Tuple{2, 2, 1}}) {
    SCOPED_TRACE(name(t));
    EngineOptions o = options(d.path(), t);
    o.cuda_graphs = true;
    std::unique_ptr<Engine> e = Engine::open(o);
    expect_logits_close(name(t) + " graph decode steps", e->prompt_logits(prompt, 1), want,
                        c.vocab_size);
    const Served first = serve(*e, c.vocab_size);
    expect_same(serve(*e, c.vocab_size), first, name(t) + " with graphs, served twice");
  }
}

TEST_F(ParallelCuda, OptionsItDoesNotOfferAreErrors) {
  TempDir d;
  write_tiny_checkpoint(tiny_preset("pro"), ExpertFormat::kNvfp4, 8, d.path(), tiny_init("pro"));
  EngineOptions o = options(d.path(), {1, 2, 1});
  o.verify = true;
  EXPECT_THROW(Engine::open(o), Error);
  o = options(d.path(), {1, 2, 1});
  o.parallel_comm = "carrier-pigeon";
  EXPECT_THROW(Engine::open(o), Error);
  o = options(d.path(), {3, 2, 1});  // 2 does not divide 3
  EXPECT_THROW(Engine::open(o), Error);
}

// Node 1 of a two-node run over NCCL (world 2, a rank per node), played by a thread of this
// process that follows the runner's start protocol over the rendezvous (NCCL's id from node 0,
// then every node's confirmation, then node 0's) and then, instead of joining NCCL's set-up,
// fails (a report, then its connection closes) or goes silent (connected, never joining). Node
// 0's runner, whose rank is by then in NCCL's set-up (blocking NCCL would wait there forever):
//  - failed: the build's watch sees the report and cancels the set-up; the runner throws
//    CollectiveAborted (a consequence: the start check reports node 1's cause) within
//    seconds, not at its 600 s deadline;
//  - silent: the set-up fails at its 4 s deadline, an Error saying so.
TEST_F(ParallelCuda, NcclStartNeverHangs) {
  TempDir d;
  write_tiny_checkpoint(tiny_preset("flash"), ExpertFormat::kNvfp4, 8, d.path(),
                        tiny_init("flash"));
  const ModelConfig config = load_model_config(d.path() + "/config.json");
  const QuantScheme scheme = QuantScheme::load(d.path(), config);
  Checkpoint ckpt(d.path());
  const WeightsRef ref = bind_weights(ckpt, config, scheme);
  CudaModelLimits lim;
  lim.max_tokens = 64;
  lim.max_seqs = 2;
  lim.max_context = 128;
  const CacheConfig cc = cache_capacity(config, 2, 128, 16);
  for (const bool silent : {false, true}) {
    const char* what = silent ? "node 1 silent" : "node 1 failed";
    SCOPED_TRACE(what);
    RendezvousOptions ro;
    ro.master_port = 20000 + int((getpid() * 7 + (silent ? 1 : 0) * 131) % 20000);
    ro.world = 2;
    ro.timeout_s = 30;
    ro.peer_noun = "node";
    std::atomic<bool> node0_done{false};
    std::string node1_error;
    std::thread node1([&] {
      RendezvousOptions mine = ro;
      mine.rank = 1;
      try {
        Rendezvous rv(mine);
        rv.broadcast({});      // NCCL's id
        rv.gather({}, 60);     // this node confirms
        rv.broadcast({}, 60);  // node 0's go: its rank enters NCCL's set-up
        std::this_thread::sleep_for(std::chrono::seconds(2));  // it is waiting there by now
        if (!silent) {
          rv.fail("node 1 failed to start: injected by the test");
          return;  // the connection closes
        }
        while (!node0_done) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      } catch (const std::exception& e) {
        node1_error = e.what();
      }
    });
    // Node 1 is joined whatever happens below (a thread left running would end the process).
    struct Joined {
      std::thread& t;
      std::atomic<bool>& done;
      ~Joined() {
        done = true;
        if (t.joinable()) t.join();
      }
    } joined{node1, node0_done};
    RendezvousOptions zero = ro;
    zero.rank = 0;
    NodePlacement node;
    node.nnodes = 2;
    node.node_rank = 0;
    node.rendezvous = std::make_shared<Rendezvous>(zero);
    ParallelCudaOptions po;
    po.comm = CudaCommKind::kNccl;
    po.nccl_setup_timeout_s = silent ? 4 : 600;
    const auto t0 = std::chrono::steady_clock::now();
    std::string error;
    bool consequence = false, built = false, no_nccl = false;
    try {
      ParallelCudaRunner r(config, ref, ParallelConfig{1, 2, 1}, cc, lim, po, node);
      built = true;
    } catch (const CollectiveAborted& e) {
      consequence = true;
      error = e.what();
    } catch (const Error& e) {
      error = e.what();
      no_nccl = error.find("no NCCL") != std::string::npos;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    node0_done = true;
    node.rendezvous.reset();  // a node 1 still reading sees the connection close
    node1.join();
    if (no_nccl) GTEST_SKIP() << error;
    EXPECT_EQ(node1_error, "");
    std::printf("  %s: node 0 ended after %.2f s: %s\n", what, seconds, error.c_str());
    EXPECT_FALSE(built);
    if (!silent) {
      EXPECT_TRUE(consequence) << error;
      EXPECT_NE(error.find("cancelled"), std::string::npos) << error;
      EXPECT_LT(seconds, 2.0 + 30.0);
    } else {
      EXPECT_FALSE(consequence) << error;
      EXPECT_NE(error.find("did not complete within 4 s"), std::string::npos) << error;
      EXPECT_GE(seconds, 4.0);
      EXPECT_LT(seconds, 4.0 + 30.0);
    }
  }
}

}  // namespace
}  // namespace dsv4::test
