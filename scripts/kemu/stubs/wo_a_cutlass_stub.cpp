// wo_a_cutlass.cu is a CUTLASS kernel, which the emulator does not compile: its entry point aborts.
#include "ops/cuda/attn_output/wo_a_kernels.h"

namespace dsv4::cuda {
void wo_a_tensor_core(const WoAArgs&, cudaStream_t) {
  ::kemu::fail("wo_a_tensor_core (CUTLASS) is not emulated");
}
}  // namespace dsv4::cuda
