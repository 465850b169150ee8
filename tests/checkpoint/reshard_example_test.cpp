// examples/checkpoint_reshard under commgrad-run: saved at one TP x DP
// layout, resumed at others, the loss curve checked by the program itself
// (bit for bit at the saved layout); rank 0's printout is checked here.

#include "harness/command_line.h"
#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

TEST(CheckpointReshardExample, SavedAtTwoByTwoResumesAtOneByFourAndFourByOne) {
  auto r = run_process({launcher_path(), "-n", "4", "--timeout", "90", build_path("bin/checkpoint_reshard")},
                       clean_env(), std::chrono::seconds(150));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] saved step 5 at TP=2 x DP=2 (4 ranks)"));
  EXPECT_THAT(r.out, HasSubstr("[0] TP=1 x DP=4: step 6 loss "));
  EXPECT_THAT(r.out, HasSubstr("[0] TP=4 x DP=1: step 6 loss "));
  EXPECT_THAT(r.out, HasSubstr("[0] TP=2 x DP=2: step 6 loss "));
  EXPECT_THAT(r.out, HasSubstr("(bit for bit): ok"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("MISMATCH")));
}

TEST(CheckpointReshardExample, TwoRanksSavedWithoutTensorParallelism) {
  auto r = run_process({launcher_path(), "-n", "2", "--timeout", "90", build_path("bin/checkpoint_reshard"),
                        "--save-tp", "1", "--load-tp", "2,1", "--steps", "6"},
                       clean_env(), std::chrono::seconds(150));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] saved step 3 at TP=1 x DP=2 (2 ranks)"));
  EXPECT_THAT(r.out, HasSubstr("[0] TP=2 x DP=1: step 4 loss "));
  EXPECT_THAT(r.out, HasSubstr("[0] TP=1 x DP=2: step 4 loss "));
}

TEST(CheckpointReshardExample, ALayoutThatDoesNotDivideTheWorldIsAnError) {
  auto r = run_process(
      {launcher_path(), "-n", "2", "--timeout", "60", build_path("bin/checkpoint_reshard"), "--load-tp", "3"},
      clean_env(), std::chrono::seconds(90));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out + r.err, HasSubstr("checkpoint_reshard: TP size 3 does not divide 2 ranks"));
}

// Every option in --help; each bad one named, exit code 2, before any rank starts.
TEST(CheckpointReshardExample, BadOptionsAreNamedBeforeAnyRankStarts) {
  const std::string program = build_path("bin/checkpoint_reshard");
  expect_help_lists(program, {"--save-tp", "--load-tp", "--steps"});
  expect_bad_options(
      program, {
                   {{"--bogus"}, "unknown option '--bogus'"},
                   {{"--save-tp", "0"}, "--save-tp: expected an integer in [1, 2147483647], got '0'"},
                   {{"--save-tp", "two"}, "--save-tp: expected an integer in [1, 2147483647], got 'two'"},
                   {{"--load-tp", "1,0"}, "--load-tp: expected an integer in [1, 2147483647], got '0'"},
                   {{"--load-tp", "1,x"}, "--load-tp: expected an integer in [1, 2147483647], got 'x'"},
                   {{"--steps", "1"}, "--steps: expected an integer in [2, 2147483647], got '1'"},
                   {{"--steps", "-1"}, "--steps: expected an integer in [2, 2147483647], got '-1'"},
                   {{"--steps", "99999999999"}, "--steps: expected an integer in [2, 2147483647], got '99999999999'"},
               });
}

}  // namespace
}  // namespace commgrad::testing
