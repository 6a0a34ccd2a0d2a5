// mHC, RMSNorm and the embedding gather at DeepSeek-V4 Flash (dim 4096) and Pro (7168) widths,
// decode batches b = 1..256 and prefill 4K / 8K tokens, in GB/s on the bytes each op must move
// (streams in/out, the fn projection, y, post/comb, norm weights), against the 4.3 TB/s HBM
// ceiling (bench_util.h). The fused hc_post_pre runs next to the unfused hc_post + hc_pre as its
// peer (past one m-tile per cluster tile, i.e. prefill, hc_post_pre itself runs the unfused
// pair, so peer/ours is ~1 there). Inputs are rotated through more memory than the L2 holds; every
// op is replayed from a CUDA graph. --dims benchmarks other widths instead (e.g. 128, 384: the
// per-token kernel of widths the cluster kernel does not take), or as well with --model.
// The Flash and Pro widths and the vocabulary are real_config.h's.
// At the widths the split-K path takes (mhc_cfg::uses_split_kernel: Flash, Pro) hc_pre,
// hc_post_pre and hc_head run on it (what the engine runs), with the cluster kernel at the same
// shape as the peer ("cluster"), timed once per graph and, up to 512 tokens, as a chain of kChain
// calls in one graph (per call: the launch latency of a lone graph amortised, consecutive calls
// overlapping by programmatic launch as in the engine's step graph). fn is rotated with the
// streams (the engine reads each layer's fn from HBM), so the decode roofline counts its bytes
// from HBM.
// Usage: mhc_bench [--model flash|pro|all] [--dims 128,384] [--tokens 1,8,4096] [--iters N]
#include <cuda_bf16.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/bench_util.h"
#include "cuda/cuda_support.h"
#include "cuda/device_fill.cuh"
#include "cuda/real_config.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/head/head.h"
#include "ops/cuda/mhc/mhc.h"
#include "ops/cuda/mhc/mhc_config.h"
#include "ops/cuda/norm/norm.h"

using namespace dsv4;
using namespace dsv4::cuda;

namespace {

using test::bf16_ptr;
constexpr int kHc = 4;
constexpr int kChain = 8;  // calls per graph in the chained timing

void emit(const std::string& kernel, const std::string& shape, double us, double bytes,
          const std::string& peer, double peer_us) {
  bench::Result r;
  r.kernel = kernel;
  r.shape = shape;
  r.us = us;
  r.flops = 0;
  r.bytes = bytes;
  r.peer = peer;
  r.peer_us = peer_us;
  r.emit();
}

// One token count at one width: every op, its bytes, the unfused peer of the fused op; the
// embedding table has `vocab` rows.
void bench_width(const char* model, int dim, int vocab, int tokens, int iters) {
  const size_t sd = size_t(tokens) * kHc * dim, xd = size_t(tokens) * dim;
  const int mix = (2 + kHc) * kHc;
  // Rotation: the streams and fn (at decode, fn is most of the bytes).
  const size_t fn_elems = size_t(mix) * kHc * dim;
  const int copies = bench::rotation_copies(sd * 2 + fn_elems * 4);
  std::vector<DeviceBuffer<uint16_t>> streams, out;
  std::vector<DeviceBuffer<float>> fns;
  for (int c = 0; c < copies; ++c) {
    streams.emplace_back(sd);
    bench::fill_bf16_kernel<<<1024, 256>>>(bf16_ptr(streams.back()), sd, 7 + c, 1e-3f);
    out.emplace_back(sd);
    fns.emplace_back(fn_elems);
    bench::fill_f32_kernel<<<1024, 256>>>(fns.back().data(), fn_elems, 100 + c, -0.02f, 0.02f);
  }
  DeviceBuffer<uint16_t> x(xd), y(xd), nw(dim);
  bench::fill_bf16_kernel<<<1024, 256>>>(bf16_ptr(x), xd, 3, 1e-3f);
  bench::fill_bf16_kernel<<<64, 256>>>(bf16_ptr(nw), dim, 4, 1e-3f);
  DeviceBuffer<float> base(mix), scale(3), hfn(size_t(kHc) * kHc * dim);
  bench::fill_f32_kernel<<<1024, 256>>>(hfn.data(), hfn.size(), 2, -0.02f, 0.02f);
  bench::fill_f32_kernel<<<1, 32>>>(base.data(), mix, 3, -1.f, 1.f);
  bench::fill_f32_kernel<<<1, 32>>>(scale.data(), 3, 4, 0.5f, 1.5f);
  DeviceBuffer<float> post(size_t(tokens) * kHc), comb(size_t(tokens) * kHc * kHc);
  DeviceBuffer<float> post2(post.size()), comb2(comb.size());
  bench::fill_f32_kernel<<<64, 256>>>(post.data(), post.size(), 5, 0.f, 2.f);
  bench::fill_f32_kernel<<<64, 256>>>(comb.data(), comb.size(), 6, 0.f, 1.f);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());

  HcShape shp;
  shp.dim = dim;
  auto unit_of = [&](int c) { return HcUnitParams{fns[c].data(), base.data(), scale.data()}; };
  const HcUnitParams hunit{hfn.data(), base.data(), scale.data()};
  const std::string shape =
      std::string(model) + " dim=" + std::to_string(dim) + " tokens=" + std::to_string(tokens);
  const double b_streams = double(sd) * 2, b_x = double(xd) * 2;
  const double b_pc = double(tokens) * 20 * 4, b_fn = double(fn_elems) * 4;

  auto pre = [&](int c, cudaStream_t s, bool norm, HcPath path = HcPath::kAuto) {
    HcPreParams p;
    p.shape = shp;
    p.tokens = tokens;
    p.streams = bf16_ptr(streams[c]);
    p.unit = unit_of(c);
    if (norm) p.norm = {bf16_ptr(nw), 1e-6f};
    p.y = bf16_ptr(y);
    p.post = post2.data();
    p.comb = comb2.data();
    p.path = path;
    hc_pre(p, s);
  };
  auto postp = [&](int c, cudaStream_t s) {
    HcPostParams p;
    p.shape = shp;
    p.tokens = tokens;
    p.x = bf16_ptr(x);
    p.res = bf16_ptr(streams[c]);
    p.post = post.data();
    p.comb = comb.data();
    p.out = bf16_ptr(out[c]);
    hc_post(p, s);
  };
  const double t_pre =
      bench::GraphSet(copies, [&](int c, cudaStream_t s) { pre(c, s, false); }).median_us(iters);
  const double t_pre_norm =
      bench::GraphSet(copies, [&](int c, cudaStream_t s) { pre(c, s, true); }).median_us(iters);
  const double t_post = bench::GraphSet(copies, postp).median_us(iters);
  // Unfused peer of hc_post_pre: hc_post writes the new streams, hc_pre reads them back.
  const double t_unfused = bench::GraphSet(copies, [&](int c, cudaStream_t s) {
                             postp(c, s);
                             HcPreParams p;
                             p.shape = shp;
                             p.tokens = tokens;
                             p.streams = bf16_ptr(out[c]);
                             p.unit = unit_of(c);
                             p.norm = {bf16_ptr(nw), 1e-6f};
                             p.y = bf16_ptr(y);
                             p.post = post2.data();
                             p.comb = comb2.data();
                             hc_pre(p, s);
                           }).median_us(iters);
  auto post_pre = [&](int c, cudaStream_t s, HcPath path) {
    HcPostPreParams p;
    p.post.shape = shp;
    p.post.tokens = tokens;
    p.post.x = bf16_ptr(x);
    p.post.res = bf16_ptr(streams[c]);
    p.post.post = post.data();
    p.post.comb = comb.data();
    p.post.out = bf16_ptr(out[c]);
    p.unit = unit_of(c);
    p.norm = {bf16_ptr(nw), 1e-6f};
    p.y = bf16_ptr(y);
    p.next_post = post2.data();
    p.next_comb = comb2.data();
    p.path = path;
    hc_post_pre(p, s);
  };
  auto head = [&](int c, cudaStream_t s, HcPath path) {
    HcHeadParams p;
    p.shape = shp;
    p.tokens = tokens;
    p.streams = bf16_ptr(streams[c]);
    p.unit = hunit;
    p.norm = {bf16_ptr(nw), 1e-6f};
    p.y = bf16_ptr(y);
    p.path = path;
    hc_head(p, s);
  };
  const double t_fused = bench::GraphSet(copies, [&](int c, cudaStream_t s) {
                           post_pre(c, s, HcPath::kAuto);
                         }).median_us(iters);
  const double t_head = bench::GraphSet(copies, [&](int c, cudaStream_t s) {
                          head(c, s, HcPath::kAuto);
                        }).median_us(iters);
  const double t_norm = bench::GraphSet(copies, [&](int c, cudaStream_t s) {
                          RmsNormParams p;
                          p.x = bf16_ptr(streams[c]);
                          p.rows = tokens;
                          p.n = dim;
                          p.weight = bf16_ptr(nw);
                          p.y = bf16_ptr(y);
                          rms_norm(p, s);
                        }).median_us(iters);

  // The split-K path (what kAuto runs at these widths) against the cluster kernel at the same
  // shape, one call per graph and, for decode steps, kChain calls per graph (per call).
  if (mhc_cfg::split_supports_dim(dim)) {
    const bool decode = tokens <= 512;
    using Op = std::function<void(int, cudaStream_t, HcPath)>;
    auto one = [&](const Op& op, HcPath path) {
      return bench::GraphSet(copies, [&](int c, cudaStream_t s) { op(c, s, path); })
          .median_us(iters);
    };
    auto chain = [&](const Op& op, HcPath path) {
      return bench::GraphSet(copies,
                             [&](int c, cudaStream_t s) {
                               for (int i = 0; i < kChain; ++i) op((c + i) % copies, s, path);
                             })
                 .median_us(iters) /
             kChain;
    };
    const Op pre_op = [&](int c, cudaStream_t s, HcPath path) { pre(c, s, true, path); };
    const double pre_bytes = b_streams + b_fn + b_x + b_pc + dim * 2.0;
    const double pp_bytes = 2 * b_streams + 2 * b_x + 2 * b_pc + b_fn + dim * 2.0;
    const double head_bytes = b_streams + b_x + double(hfn.size()) * 4 + dim * 2.0;
    struct Case {
      const char* name;
      Op op;
      double bytes;
    };
    const Case cases[] = {{"hc_pre+norm", pre_op, pre_bytes},
                          {"hc_post_pre+norm", post_pre, pp_bytes},
                          {"hc_head+norm", head, head_bytes}};
    for (const Case& k : cases) {
      emit(std::string(k.name) + " [split]", shape, one(k.op, HcPath::kSplit), k.bytes, "cluster",
           one(k.op, HcPath::kCluster));
      if (decode)
        emit(std::string(k.name) + " [split] x" + std::to_string(kChain) + " chain", shape,
             chain(k.op, HcPath::kSplit), k.bytes, "cluster chain", chain(k.op, HcPath::kCluster));
    }
  }

  emit("hc_pre", shape, t_pre, b_streams + b_fn + b_x + b_pc, "", 0);
  emit("hc_pre+norm", shape, t_pre_norm, b_streams + b_fn + b_x + b_pc + dim * 2.0, "", 0);
  emit("hc_post", shape, t_post, 2 * b_streams + b_x + b_pc, "", 0);
  emit("hc_post_pre+norm", shape, t_fused, 2 * b_streams + 2 * b_x + 2 * b_pc + b_fn + dim * 2.0,
       "hc_post+hc_pre(unfused)", t_unfused);
  emit("hc_head+norm", shape, t_head, b_streams + b_x + double(hfn.size()) * 4 + dim * 2.0, "", 0);
  emit("rms_norm", shape, t_norm, 2 * b_x + dim * 2.0, "", 0);

  // Embedding gather + repeat into the 4 streams.
  {
    DeviceBuffer<uint16_t> table(size_t(vocab) * dim);
    bench::fill_bf16_kernel<<<1024, 256>>>(bf16_ptr(table), table.size(), 9, 1e-3f);
    std::vector<int32_t> ids(tokens);
    for (int t = 0; t < tokens; ++t) ids[t] = int32_t((uint64_t(t) * 2654435761u) % vocab);
    DeviceBuffer<int32_t> dids(ids);
    const double t_emb = bench::GraphSet(copies, [&](int c, cudaStream_t s) {
                           EmbedParams p;
                           p.tokens = dids.data();
                           p.n = tokens;
                           p.table = bf16_ptr(table);
                           p.vocab = vocab;
                           p.dim = dim;
                           p.repeat = kHc;
                           p.out = bf16_ptr(out[c]);
                           embed(p, s);
                         }).median_us(iters);
    emit("embed(repeat 4)", shape, t_emb, b_x + b_streams + tokens * 4.0, "", 0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool flash = true, pro = true, model_given = false;
  std::vector<int> tokens = {1, 2, 4, 8, 16, 32, 64, 128, 256, 4096, 8192};
  std::vector<int> dims;
  int iters = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) {
      const std::string m = argv[++i];
      flash = m == "flash" || m == "all";
      pro = m == "pro" || m == "all";
      model_given = true;
    } else if (a == "--dims" && i + 1 < argc) {
      for (char* t = std::strtok(argv[++i], ","); t; t = std::strtok(nullptr, ","))
        dims.push_back(std::atoi(t));
    } else if (a == "--tokens" && i + 1 < argc) {
      tokens.clear();
      for (char* t = std::strtok(argv[++i], ","); t; t = std::strtok(nullptr, ","))
        tokens.push_back(std::atoi(t));
    } else if (a == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--model flash|pro|all] [--dims 128,384] [--tokens 1,8,4096] "
                   "[--iters N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!dims.empty() && !model_given) flash = pro = false;
  // The real widths and vocabulary; --dims widths embed from the same vocabulary.
  const ModelConfig fc = bench::real_config("flash", false), pc = bench::real_config("pro", false);
  for (int t : tokens) {
    if (flash) bench_width("flash", fc.dim, fc.vocab_size, t, iters);
    if (pro) bench_width("pro", pc.dim, pc.vocab_size, t, iters);
    for (int d : dims) bench_width(("dim" + std::to_string(d)).c_str(), d, fc.vocab_size, t, iters);
  }
  return 0;
}
