// Quantisers into the checkpoint formats, for writing checkpoints (dsv4 make-tiny, tests):
// DeepSeek's FP8 (128x128 UE8M0 blocks) and MXFP4 (UE8M0 per 32), and NVIDIA ModelOpt's NVFP4
// (E4M3 per 16 with an fp32 global scale). All round to nearest even.
#pragma once

#include <cstdint>
#include <vector>

namespace dsv4 {

struct Fp8Weight {
  std::vector<uint8_t> codes;   // e4m3 [out, in]
  std::vector<uint8_t> scales;  // E8M0 [ceil(out/128), ceil(in/128)]
};
// Per block: s = 2^ceil(log2(amax/448)), q = e4m3(w/s).
Fp8Weight quantize_fp8_weight(const std::vector<float>& w, int out, int in);

struct Mxfp4Weight {
  std::vector<uint8_t> packed;  // [out, in/2], element 2k in the low nibble
  std::vector<uint8_t> scales;  // E8M0 [out, in/32]
};
// Per 32 along `in`: s = 2^ceil(log2(amax/6)), q = e2m1(w/s).
Mxfp4Weight quantize_mxfp4_weight(const std::vector<float>& w, int out, int in);

struct Nvfp4Weight {
  std::vector<uint8_t> packed;  // [out, in/2]
  std::vector<uint8_t> scales;  // E4M3 [out, in/16]
  float scale_2 = 1;            // global fp32 scale
};
// ModelOpt's scheme with a given global scale (amax / (6*448) of the tensor, or the max over
// tensors that share it): block scale = e4m3(amax_16 / (6 * scale_2)),
// q = e2m1(w / (block_scale * scale_2)).
Nvfp4Weight quantize_nvfp4_weight(const std::vector<float>& w, int out, int in, float scale_2);
float nvfp4_global_scale(const std::vector<float>& w);

}  // namespace dsv4
