// Groups created and dropped in a row on Gloo: every rank finishes (no rank
// stranded by a peer that closed its connections right after creating the
// group; see "Group creation ends with ..." in src/dist/process_group.cpp).

#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace commgrad::testing {
namespace {

TEST(GroupChurnTest, ModelParallelStatesCreatedAndDroppedInARowOnGloo) {
  // A stranded rank would wait out the group timeout: 20 s makes that a
  // failure of this test, not a five-minute hang.
  for (int run = 0; run < 3; ++run) {
    const auto result = run_process({launcher_path(), "-n", "4", build_path("tests/dist/group_churn_job"), "12"},
                                    clean_env({{"COMMGRAD_TIMEOUT", "20"}}), std::chrono::seconds(90));
    ASSERT_EQ(result.exit_code, 0) << "run " << run << "\n" << result.out << result.err;
    for (int r = 0; r < 4; ++r) {
      EXPECT_THAT(result.out, ::testing::HasSubstr("rank " + std::to_string(r) + " ok")) << "run " << run;
    }
  }
}

}  // namespace
}  // namespace commgrad::testing
