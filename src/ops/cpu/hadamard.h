// Walsh-Hadamard rotation (Sylvester order) scaled by n^-1/2, as fast_hadamard_transform:
// fp32 butterflies, BF16 out. n must be a power of two.
#pragma once

namespace dsv4::cpu {

void hadamard_rotate(float* x, int n);

}  // namespace dsv4::cpu
