// The GPU tests' fixture: every test skips, saying why, on a machine without a usable GPU.
#pragma once

#include <gtest/gtest.h>

#include "ops/cuda/common/device.h"

#define DSV4_SKIP_WITHOUT_GPU()                                           \
  do {                                                                    \
    if (::dsv4::cuda::device_count() == 0)                                \
      GTEST_SKIP() << "needs a GPU: " << ::dsv4::cuda::describe_device(); \
  } while (0)

namespace dsv4::test {

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override { DSV4_SKIP_WITHOUT_GPU(); }
};

}  // namespace dsv4::test
