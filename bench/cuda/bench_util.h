// Timing GPU kernels the way the anchors were measured: CUDA events, inputs rotated through
// more memory than the L2 holds, median of many runs; results appended as one JSON object per
// line with the GPU, date and commit, next to the ceilings they are judged against.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "ops/cuda/common/cuda_check.h"

namespace dsv4::bench {

// Measured on one H200 (../shared/spec/anchors.md).
constexpr double kHbmTBps = 4.3;
constexpr double kBf16Tflops = 749;
constexpr double kFp8Tflops = 1454;

// Median time in microseconds of `run(i)` (i = rotation index), after `warmup` calls.
inline double median_us(const std::function<void(int)>& run, int iters = 50, int warmup = 5) {
  cudaEvent_t a, b;
  DSV4_CUDA_CHECK(cudaEventCreate(&a));
  DSV4_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) run(i);
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    DSV4_CUDA_CHECK(cudaEventRecord(a));
    run(i);
    DSV4_CUDA_CHECK(cudaEventRecord(b));
    DSV4_CUDA_CHECK(cudaEventSynchronize(b));
    float ms;
    DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.0f);
  }
  DSV4_CUDA_CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// How many copies of an input of `bytes` make the rotation exceed the L2 (60 MB) twice over.
inline int rotation_copies(size_t bytes) {
  const size_t l2x2 = 120ull << 20;
  return int(
      std::max<size_t>(1, std::min<size_t>(64, (l2x2 + bytes - 1) / std::max<size_t>(bytes, 1))));
}

inline std::string gpu_name() {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "unknown";
  return p.name;
}

inline std::string today() {
  char buf[32];
  std::time_t t = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

inline std::string commit() {
  const char* c = std::getenv("DSV4_COMMIT");
  return c ? c : "unknown";
}

// Each timed operation is captured once per weight copy into a CUDA graph and replayed, so the
// timings are GPU time (as the engine's decode graphs will run) rather than host launch cost.
struct GraphSet {
  std::vector<cudaGraphExec_t> execs;
  GraphSet(int copies, const std::function<void(int, cudaStream_t)>& op) {
    cudaStream_t s;
    DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    op(0, s);  // warm-up outside the capture: one-time attributes, cuBLAS workspaces
    DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
    for (int c = 0; c < copies; ++c) {
      cudaGraph_t g;
      cudaGraphExec_t e;
      DSV4_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
      op(c, s);
      DSV4_CUDA_CHECK(cudaStreamEndCapture(s, &g));
      DSV4_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
      DSV4_CUDA_CHECK(cudaGraphDestroy(g));
      execs.push_back(e);
    }
    DSV4_CUDA_CHECK(cudaStreamDestroy(s));
  }
  ~GraphSet() {
    for (auto e : execs) cudaGraphExecDestroy(e);
  }
  void launch(int i) const {
    DSV4_CUDA_CHECK(cudaGraphLaunch(execs[size_t(i) % execs.size()], nullptr));
  }
  double median_us(int iters) const {
    return ::dsv4::bench::median_us([&](int i) { launch(i); }, iters);
  }
};

// One result line (JSON) to stdout and to $DSV4_BENCH_OUT when set.
struct Result {
  std::string kernel, shape, peer;
  double us = 0, flops = 0, bytes = 0, peer_us = 0;
  double tensor_rate_tflops = kBf16Tflops;  // the ceiling for this kernel's math format

  void emit() const {
    const double tflops = flops / us / 1e6, tbps = bytes / us / 1e6;
    const double bound_us = std::max(bytes / (kHbmTBps * 1e6), flops / (tensor_rate_tflops * 1e6));
    char line[1024];
    std::snprintf(line, sizeof line,
                  "{\"kernel\":\"%s\",\"shape\":\"%s\",\"us\":%.2f,\"TFLOPS\":%.1f,\"TBps\":%.3f,"
                  "\"roofline_us\":%.2f,\"of_roofline\":%.3f,\"peer\":\"%s\",\"peer_us\":%.2f,"
                  "\"gpu\":\"%s\",\"date\":\"%s\",\"commit\":\"%s\"}",
                  kernel.c_str(), shape.c_str(), us, tflops, tbps, bound_us, bound_us / us,
                  peer.c_str(), peer_us, gpu_name().c_str(), today().c_str(), commit().c_str());
    std::printf("%s\n", line);
    if (const char* out = std::getenv("DSV4_BENCH_OUT")) {
      if (FILE* f = std::fopen(out, "a")) {
        std::fprintf(f, "%s\n", line);
        std::fclose(f);
      }
    }
  }
};

}  // namespace dsv4::bench
