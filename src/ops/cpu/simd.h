// Hot inner loops of the CPU backend, compiled for AVX-512F, AVX2 and the baseline ISA and chosen
// at run time (GCC function multi-versioning). Each does the same IEEE operations in the same
// order in every version (no FMA contraction), so results are identical on every machine.
#pragma once

// (Not under ThreadSanitizer: the ifunc resolvers run before its runtime is up and crash.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define DSV4_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DSV4_MULTIVERSION
#endif

namespace dsv4::cpu {

// acc[i] += a * double(w[i]) for i < n.
void axpy_f64(double* acc, double a, const float* w, int n);
// sum of double(a[i]) * double(b[i]) with eight interleaved partial sums in a fixed order.
double dot_f64(const float* a, const float* b, int n);

}  // namespace dsv4::cpu
