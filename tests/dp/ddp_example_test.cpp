// examples/ddp_train as real processes under commgrad-run at 1, 2 and 4
// ranks: it trains with DistributedDataParallel, also trains one process on
// the full batches, and exits non-zero when the two differ; rank 0's
// printout is checked here.

#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

class DdpTrainExample : public ::testing::TestWithParam<int> {};

TEST_P(DdpTrainExample, MatchesSingleProcessUnderCommgradRun) {
  const int n = GetParam();
  // Launcher variables of an enclosing job must not leak into the ranks.
  const std::map<std::string, std::string> env = {{"RANK", ""}, {"WORLD_SIZE", ""}, {"MASTER_ADDR", ""},
                                                  {"MASTER_PORT", ""}, {"COMMGRAD_BACKEND", ""}};
  auto r = run_process({launcher_path(), "-n", std::to_string(n), "--timeout", "90", build_path("bin/ddp_train"),
                        "--epochs", "3", "--bucket-cap-mb", "0.01"},
                       env, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] world: " + std::to_string(n) + " ranks, backend gloo"));
  EXPECT_THAT(r.out, HasSubstr("[0] epoch 1/3: loss "));
  EXPECT_THAT(r.out, HasSubstr("[0] epoch 3/3: loss "));
  EXPECT_THAT(r.out, HasSubstr(": ok\n"));
  EXPECT_TRUE(lines_with_prefix(r.out, "[1] ").empty()) << r.out;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DdpTrainExample, ::testing::Values(1, 2, 4));

}  // namespace
}  // namespace commgrad::testing
