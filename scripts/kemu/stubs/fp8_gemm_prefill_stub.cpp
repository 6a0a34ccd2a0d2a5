// fp8_gemm_prefill.cu is a CUTLASS kernel, which the emulator does not compile: its entry points
// abort.
#include "ops/cuda/gemm/fp8_gemm_prefill.h"

namespace dsv4::cuda::detail {
size_t prefill_workspace_bytes(const PrefillArgs&) {
  return 0;
}
bool prefill_can_implement(const PrefillArgs&) {
  ::kemu::fail("the CUTLASS prefill GEMM is not emulated");
}
void prefill_gemm(const PrefillArgs&, void*, size_t, cudaStream_t) {
  ::kemu::fail("the CUTLASS prefill GEMM is not emulated");
}
}  // namespace dsv4::cuda::detail
