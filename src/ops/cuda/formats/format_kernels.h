// Device-side conversions of the cache and weight number formats, checked against the CPU
// tables (core/formats.h): every kernel that reads FP8/FP4 relies on these agreeing.
#pragma once

#include <cstdint>
#include <vector>

namespace dsv4::cuda {

// Decodes every e4m3 code (256) and every e2m1 code (16) on the device.
void decode_all_codes(std::vector<float>& e4m3, std::vector<float>& e2m1);
// Encodes floats to e4m3 (saturating, round to nearest even) and to BF16 on the device.
void encode_on_device(const std::vector<float>& x, std::vector<uint8_t>& e4m3,
                      std::vector<uint16_t>& bf16);

}  // namespace dsv4::cuda
