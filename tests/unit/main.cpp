// The unit tests' main: the process flushes subnormal floats as `origami` does (kernels/cpu/gemm.h,
// flush_denormals), before any thread starts, so that the kernels run here as they run there.
#include <gtest/gtest.h>

#include "kernels/cpu/gemm.h"

int main(int argc, char** argv) {
  origami::flush_denormals();
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
