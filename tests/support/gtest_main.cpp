// The test executables' main: Google Test, plus exit code 77 when every test that ran was
// skipped (no GPU, no golden data), which CTest reports as "Skipped" (SKIP_RETURN_CODE). A run
// with any failure keeps its failing exit code, and one with passes next to skips passes, its
// skipped cases listed in the output.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  const ::testing::UnitTest& u = *::testing::UnitTest::GetInstance();
  if (rc == 0 && u.test_to_run_count() > 0 && u.skipped_test_count() == u.test_to_run_count())
    return 77;
  return rc;
}
