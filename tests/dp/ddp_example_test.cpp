// examples/ddp_train as real processes under commgrad-run at 1, 2 and 4
// ranks: it trains with DistributedDataParallel, also trains one process on
// the full batches, and exits non-zero when the two differ; rank 0's
// printout is checked here.

#include "harness/command_line.h"
#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

// (ranks, COMMGRAD_BACKEND; empty: the default transport)
class DdpTrainExample : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(DdpTrainExample, MatchesSingleProcessUnderCommgradRun) {
  const int n = std::get<0>(GetParam());
  const auto backend = std::get<1>(GetParam());
  // Launcher variables of an enclosing job must not leak into the ranks.
  const auto env = clean_env({{"COMMGRAD_BACKEND", backend}});
  auto r = run_process({launcher_path(), "-n", std::to_string(n), "--timeout", "90", build_path("bin/ddp_train"),
                        "--epochs", "3", "--bucket-cap-mb", "0.01"},
                       env, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] world: " + std::to_string(n) + " ranks, backend " +
                               (backend.empty() ? "" : backend + ";")));
  EXPECT_THAT(r.out, HasSubstr("[0] epoch 1/3: loss "));
  EXPECT_THAT(r.out, HasSubstr("[0] epoch 3/3: loss "));
  EXPECT_THAT(r.out, HasSubstr(": ok\n"));
  EXPECT_TRUE(lines_with_prefix(r.out, "[1] ").empty()) << r.out;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DdpTrainExample,
                         ::testing::Values(std::make_tuple(1, std::string()), std::make_tuple(2, std::string()),
                                           std::make_tuple(4, std::string()), std::make_tuple(2, std::string("gloo")),
                                           std::make_tuple(4, std::string("gloo"))),
                         [](const auto& info) {
                           const auto& backend = std::get<1>(info.param);
                           return (backend.empty() ? std::string("default") : backend) + "_" +
                                  std::to_string(std::get<0>(info.param));
                         });

// Every option in --help; each bad one named, exit code 2, before any rank starts.
TEST(DdpTrainExample, BadOptionsAreNamedBeforeAnyRankStarts) {
  const std::string program = build_path("bin/ddp_train");
  expect_help_lists(program, {"--epochs", "--bucket-cap-mb", "--device"});
  expect_bad_options(
      program, {
                   {{"--bogus", "1"}, "unknown option '--bogus'"},
                   {{"--epochs", "0"}, "--epochs: expected an integer in [1, 2147483647], got '0'"},
                   {{"--epochs", "-1"}, "--epochs: expected an integer in [1, 2147483647], got '-1'"},
                   {{"--epochs", "five"}, "--epochs: expected an integer in [1, 2147483647], got 'five'"},
                   {{"--epochs", "99999999999"}, "--epochs: expected an integer in [1, 2147483647], got '99999999999'"},
                   {{"--bucket-cap-mb", "0"}, "--bucket-cap-mb: expected a number > 0, got '0'"},
                   {{"--bucket-cap-mb", "big"}, "--bucket-cap-mb: expected a number > 0, got 'big'"},
                   {{"--device", "gpu"}, "--device: expected one of cpu, cuda, got 'gpu'"},
               });
}

}  // namespace
}  // namespace commgrad::testing
