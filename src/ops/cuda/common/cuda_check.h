// Every CUDA runtime call is checked; a failure becomes a dsv4::Error naming the call.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define DSV4_CUDA_CHECK(call)                                                             \
  do {                                                                                    \
    cudaError_t err_ = (call);                                                            \
    if (err_ != cudaSuccess)                                                              \
      throw ::dsv4::Error(::dsv4::cat(#call, " failed: ", cudaGetErrorString(err_), " (", \
                                      __FILE__, ":", __LINE__, ")"));                     \
  } while (0)
