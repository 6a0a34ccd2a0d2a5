// The load-time guard against non-finite weights: every floating-point tensor of a checkpoint
// (BF16, F16, F32, F64 and the FP8 formats: e4m3 weights and block scales, UE8M0 scales)
// scanned once for NaN and infinities, on all cores, before any backend uses it. A non-finite
// weight would otherwise turn every logit into NaN and the sampler's output into garbage. (The
// CPU backend's decoders check FP8 values again; the CUDA backend uploads codes as they are.)
// Packed FP4 (e2m1) has no non-finite codes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "io/tensor_view.h"

namespace dsv4 {

struct WeightScan {
  int64_t tensors = 0;                // floating-point tensors scanned
  int64_t bytes = 0;                  // their bytes
  int64_t non_finite = 0;             // NaN / +-inf values found, over all tensors
  int64_t bad_tensors = 0;            // tensors holding at least one
  const TensorView* first = nullptr;  // the first such tensor in the order given
  int64_t first_index = -1;           // flat index of its first non-finite value
  double first_value = 0;             // that value (NaN or +-inf)
};

// Whether the scan reads tensors of this dtype.
bool scanned_dtype(DType t);

// Scans `tensors` (others than scanned_dtype are skipped) with `threads` workers (0: one per
// core).
WeightScan scan_weights(const std::vector<const TensorView*>& tensors, int threads = 0);

// "tensor 'x' holds NaN at index 12 ([0, 12] of [4, 256]); 3 non-finite values in 2 tensors"
std::string describe_non_finite(const WeightScan& s);

// Scans every tensor of the checkpoint; throws dsv4::Error naming the checkpoint, the first
// tensor (in name order) with a non-finite value, its index and the totals.
void check_weights_finite(const Checkpoint& checkpoint, int threads = 0);

}  // namespace dsv4
