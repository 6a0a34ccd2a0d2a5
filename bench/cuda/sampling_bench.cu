// GPU sampling (ops/cuda/sampling) at the real vocabulary: batches of 1, 8, 32, 128 and 256
// rows of 129,280 fp32 logits: plain greedy (the usual decode step: no logprobs, so no
// log-sum-exp and no top alternatives), then greedy and seeded sampling (T 0.8 with top-k 50
// and top-p 0.9; T 1 with top-p 0.95 alone), each with logprobs and 5 top alternatives. Timed: one
// step's launch (the parameter upload, the three kernels, the results download) with CUDA events,
// logits rotated through more memory than the L2 holds. The roofline is one read of the
// logits; the peer is what the host path paid before any sampling: the download of every row
// into pinned memory.
// Usage: sampling_bench [--iters N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/bench_util.h"
#include "cuda/device_fill.cuh"
#include "cuda/real_config.h"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/sampling/device_sampler.h"

using namespace dsv4;
using namespace dsv4::cuda;

namespace {

double median(std::vector<float> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void bench_mode(const std::string& name, const SamplingParams& params, int vocab, int batch,
                int iters) {
  const size_t n = size_t(batch) * vocab;
  const int copies = bench::rotation_copies(n * sizeof(float));
  std::vector<DeviceBuffer<float>> logits;
  for (int c = 0; c < copies; ++c) {
    logits.emplace_back(n);
    bench::fill_f32_kernel<<<1024, 256>>>(logits.back().data(), n, 17 + c, -12.f, 12.f);
  }
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceSampler sampler(vocab, batch, batch);
  std::vector<DeviceSampler::Sample> samples;
  for (int r = 0; r < batch; ++r) samples.push_back({r, &params, r, nullptr, -1});
  cudaEvent_t a, b;
  DSV4_CUDA_CHECK(cudaEventCreate(&a));
  DSV4_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = -5; i < iters; ++i) {
    sampler.stage(batch, samples, {});  // host work, outside the timed span
    DSV4_CUDA_CHECK(cudaEventRecord(a));
    sampler.launch(logits[size_t(i + 5) % logits.size()].data(), nullptr);
    DSV4_CUDA_CHECK(cudaEventRecord(b));
    DSV4_CUDA_CHECK(cudaEventSynchronize(b));
    float ms;
    DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 0) t.push_back(ms * 1000.0f);
  }
  // The peer: every row downloaded into pinned memory.
  float* host = nullptr;
  DSV4_CUDA_CHECK(cudaMallocHost(&host, n * sizeof(float)));
  std::vector<float> peer;
  for (int i = -2; i < std::max(5, iters / 4); ++i) {
    DSV4_CUDA_CHECK(cudaEventRecord(a));
    DSV4_CUDA_CHECK(cudaMemcpyAsync(host, logits[0].data(), n * sizeof(float),
                                    cudaMemcpyDeviceToHost, nullptr));
    DSV4_CUDA_CHECK(cudaEventRecord(b));
    DSV4_CUDA_CHECK(cudaEventSynchronize(b));
    float ms;
    DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 0) peer.push_back(ms * 1000.0f);
  }
  DSV4_CUDA_CHECK(cudaFreeHost(host));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  bench::Result r;
  r.kernel = "sampling_" + name;
  r.shape = "batch=" + std::to_string(batch) + " vocab=" + std::to_string(vocab);
  r.us = median(t);
  r.bytes = double(n) * sizeof(float);
  r.peer = "download all rows (host path)";
  r.peer_us = median(peer);
  r.emit();
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--iters N]\n", argv[0]);
      return 2;
    }
  }
  SamplingParams plain;
  SamplingParams greedy;
  greedy.logprobs = true;
  greedy.top_logprobs = 5;
  SamplingParams topk_topp = greedy;
  topk_topp.temperature = 0.8f;
  topk_topp.top_k = 50;
  topk_topp.top_p = 0.9f;
  topk_topp.seed = 7;
  SamplingParams topp = greedy;
  topp.temperature = 1.0f;
  topp.top_p = 0.95f;
  topp.seed = 7;
  // The real vocabulary (real_config.h; Flash and Pro share it).
  const int vocab = bench::real_config("flash", false).vocab_size;
  for (int batch : {1, 8, 32, 128, 256}) {
    bench_mode("greedy_plain", plain, vocab, batch, iters);
    bench_mode("greedy", greedy, vocab, batch, iters);
    bench_mode("T0.8_topk50_topp0.9", topk_topp, vocab, batch, iters);
    bench_mode("T1_topp0.95", topp, vocab, batch, iters);
  }
  return 0;
}
