// sampling.cu builds on CUB, which the emulator does not compile: its entry point aborts.
#include "ops/cuda/sampling/sampling.h"

namespace dsv4::cuda {
void sample_rows(const SamplingLaunch&, cudaStream_t) {
  ::kemu::fail("sample_rows (CUB) is not emulated");
}
}  // namespace dsv4::cuda
