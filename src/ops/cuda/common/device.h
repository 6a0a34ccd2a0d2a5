// Which CUDA devices this process can use.
#pragma once

#include <string>

namespace dsv4::cuda {

// Number of usable devices; 0 when there is no driver or no device (never throws).
int device_count();
// "NVIDIA H200 (sm_90, 141 GB)" for device 0, or why there is none.
std::string describe_device();

}  // namespace dsv4::cuda
