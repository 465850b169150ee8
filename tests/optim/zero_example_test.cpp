// examples/zero_train as real processes under commgrad-run: it trains with
// the sharded optimizer and, in the same job, with DDP and an unsharded
// optimizer, and exits non-zero when the parameters differ (bit for bit on
// shm); rank 0's printout is checked here.

#include "harness/command_line.h"
#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

// (ranks, COMMGRAD_BACKEND (empty: the default), extra arguments)
struct Case {
  int ranks;
  std::string backend;
  std::vector<std::string> args;
  std::string name;
};

void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

class ZeroTrainExample : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroTrainExample, MatchesDdpUnderCommgradRun) {
  const auto& c = GetParam();
  const auto env = clean_env({{"COMMGRAD_BACKEND", c.backend}});
  std::vector<std::string> cmd{launcher_path(), "-n", std::to_string(c.ranks),
                               "--timeout",     "90", build_path("bin/zero_train")};
  cmd.insert(cmd.end(), c.args.begin(), c.args.end());
  auto r = run_process(cmd, env, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] world: " + std::to_string(c.ranks) + " ranks, backend "));
  EXPECT_THAT(r.out, HasSubstr("[0] epoch 3/3: loss "));
  EXPECT_THAT(r.out, HasSubstr("[0] optimizer state per rank: "));
  EXPECT_THAT(r.out, HasSubstr(c.backend == "gloo" && c.ranks > 2 ? "(tolerance 1e-05): ok\n" : "(bit for bit on "));
  EXPECT_THAT(r.out, HasSubstr(": ok\n"));
  EXPECT_TRUE(lines_with_prefix(r.out, "[1] ").empty()) << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ZeroTrainExample,
    ::testing::Values(Case{1, "", {}, "default_1"}, Case{2, "", {}, "default_2"}, Case{4, "", {}, "default_4"},
                      Case{4, "", {"--stage", "1", "--optimizer", "sgd"}, "stage1_sgd_4"},
                      Case{4, "", {"--optimizer", "adamw", "--accumulate", "3"}, "adamw_accumulate3_4"},
                      Case{3, "gloo", {"--optimizer", "adamw"}, "gloo_3"}),
    [](const auto& info) { return info.param.name; });

TEST(ZeroTrainExample, BadArgumentsExitNonZeroWithTheReason) {
  auto r =
      run_process({launcher_path(), "-n", "2", "--timeout", "30", build_path("bin/zero_train"), "--accumulate", "5"},
                  clean_env({}), std::chrono::seconds(60));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out + r.err, HasSubstr("zero_train: --accumulate must divide the batch of 24"));
}

// Every option in --help; each bad one named, exit code 2, before any rank starts.
TEST(ZeroTrainExample, BadOptionsAreNamedBeforeAnyRankStarts) {
  const std::string program = build_path("bin/zero_train");
  expect_help_lists(program,
                    {"--stage", "--optimizer", "--epochs", "--accumulate", "--max-grad-norm", "--bucket-cap-mb"});
  expect_bad_options(program,
                     {
                         {{"--bogus"}, "unknown option '--bogus'"},
                         {{"--stage", "3"}, "--stage: expected an integer in [1, 2], got '3'"},
                         {{"--optimizer", "lamb"}, "--optimizer: expected one of adam, adamw, sgd, got 'lamb'"},
                         {{"--epochs", "0"}, "--epochs: expected an integer in [1, 2147483647], got '0'"},
                         {{"--epochs", "-1"}, "--epochs: expected an integer in [1, 2147483647], got '-1'"},
                         {{"--accumulate", "0"}, "--accumulate: expected an integer in [1, 2147483647], got '0'"},
                         {{"--accumulate", "two"}, "--accumulate: expected an integer in [1, 2147483647], got 'two'"},
                         {{"--accumulate", "5"}, "--accumulate must divide the batch of 24"},
                         {{"--max-grad-norm", "-1"}, "--max-grad-norm: expected a number >= 0, got '-1'"},
                         {{"--bucket-cap-mb", "0"}, "--bucket-cap-mb: expected a number > 0, got '0'"},
                     });
}

}  // namespace
}  // namespace commgrad::testing
